"""Parts the jobs share, none a job itself: gqa (the GQA paper's models, uptrainings and timing,
under gqa_table and gqa_figure4/5/6), real_kv and toy_kv (the pretrained and toy models of the
real-model and frontier studies, with their measurements), kv_frontier_report (the frontier's
tables and figures), press_board and press_peer (the presses table's leaderboard and kvpress's
answers beside it)."""
