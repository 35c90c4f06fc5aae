import pytest

from kvjax.config import ModelConfig


@pytest.fixture
def tiny() -> ModelConfig:
  """A benchmark model small enough to run every benchmark end to end in seconds."""
  return ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=64)
