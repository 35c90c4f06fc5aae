"""The long-context suite, in layers (pyproject.toml's import contracts): axis (the suite as a
study's recall axis); passkey_run and ruler_answers (answers and per-sample records); ruler_tasks
(RULER's tasks); ruler_prompts (their haystacks and templates); passkey and recall (the pass-key
prompt and the recall measurement)."""
