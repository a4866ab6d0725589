"""`agl eval`: a checkpoint (or a served model) through the same harness, sidecar, runner, receiver
and store as training, k attempts a task, scored (pass@k, mean@k, per task) and written with a
receipt of everything the score depends on.

    scores.py   pass@k (the unbiased estimator), mean@k, per-task results
    receipt.py  the receipt: model hash, harness version, budgets, sampling, tasks hash, machine
    run.py      one evaluation: start the parts (run/serving.py), run, write results + receipt
    compare.py  two receipts' results side by side; refuses when budgets or sampling differ
"""
