"""Sampling: a step's rollout and score phases. The engines that decode completions (`generation`: our fast
loop and transformers' generate; `grouped_decode`: the fast loop's shared-prompt step; `vllm_engine`), the
fixed lag's adapter versions and worker (`lag`), the collector that samples a step's groups and scores them
(`rollout`, through `scoring` and the rewards), and the learned reward model (`reward_models`).

It hands the learning side one typed record, `learning.batch.Batch`; the only other thing it takes from
there is the fused LoRA layer, for a lag worker's own copy of the model.
"""
