"""Learning: a scored batch becomes an update. The algorithms (`algorithm_configs`: their torch-free config
models; `algorithms`: advantage estimator + loss + critic), the advantage estimators (`advantages`), the
batch record (`batch`), the policy's forward and its per-token statistics (`forward`, `losses`), the update
loop over minibatches and micro-batches (`learner`) and the fused LoRA layer (`fused_lora`).

It imports nothing from `sampling` (the config section `docuchat_rl.config` reads keeps this package's
`__init__` free of torch).
"""
