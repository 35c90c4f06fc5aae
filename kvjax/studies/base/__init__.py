"""The measurement layer every study job stands on, each module independent of the others:
measure (protocols, answers, decode steps), models (the models a study loads), report (the one
report writer), scoring (RULER's scorers, per-sample records), stages (pre-training, uptraining,
timing, cached in a workdir), tasks (the training and evaluation tasks) and variants (a study's
caches and models as values, and their one name)."""
