"""`agl eval`: a checkpoint (or a served model) through the same harness, sidecar, runner, receiver
and store as training, k attempts a task, scored (pass@k, mean@k, per task) and written with a
receipt of everything the score depends on.

    scores.py   pass@k (the unbiased estimator), mean@k, per-task results
    receipt.py  the receipt: model hash, harness version, budgets, sampling, tasks hash, machine
    compare.py  two receipts' results side by side; refuses when budgets or sampling differ
    rounds.py   the same receipts for training's validation rounds

One evaluation (start the parts, run, write results + receipt) is wiring: run/evaluation.py, which
imports this package; nothing here imports agl_trainer.run.
"""
