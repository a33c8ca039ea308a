"""Evaluation of checkpoints with lm-evaluation-harness (the optional `layerswap[eval]` extra).

spec: what to run (validated at submit). tasks: which task names exist (lm-eval's own, the
shipped local MGSM tasks, LAYERSWAP_EVAL_TASKS_DIR). runner: one evaluation, with progress,
cancellation, a deadline and a resumable request cache. results: lm-eval's output as score rows
and per-sample records. compare: is a score difference more than noise. random_weights: the mark
of checkpoints whose scores are 0 by construction (the examples).
"""
