"""Learning: a scored batch becomes an update. The algorithms (`algorithms`: advantage estimator + loss +
critic; their torch-free config models live in the config layer, `docuchat_rl/algorithm_configs.py`), the
advantage estimators (`advantages`), the batch record (`batch`), the policy's forward and its per-token
statistics (`forward`, `losses`), the update loop over minibatches and micro-batches (`learner`) and the fused
LoRA layer (`fused_lora`).

It imports nothing from `sampling` (.importlinter holds the layers).
"""
