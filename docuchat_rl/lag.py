"""Fixed-lag sampling (`rollout.async_lag: k`): step t trains on completions sampled by the policy after
step t - 1 - k (version v = the adapter after step v; 0 = the initial one), whatever the timing.

The schedule is fixed, not "whatever the sampler has by then", so a run is reproducible and resumes
exactly: a checkpoint of step t holds the adapter versions t - k .. t - 1 that the next steps still sample
with (`lagged/adapter-v<N>.safetensors`), the versions before are dropped as the run goes. The learner's
ratio is taken against the sampler's own log-probs (the "old" side is the policy that sampled, decoupled
PPO), so `num_iterations`, the clip and `rollout.correction` see the real off-policy gap.

Deliberately left out (not built yet): generation in a worker process of its own overlapping the update
(the versions are swapped into the learner's model for the rollout, so the lag costs learning and buys no
speed here), several training processes, the vLLM engine, and dynamic sampling (whose refill reads the
same step's rewards); each is refused in one line.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

FOLDER = "lagged"


class LaggedPolicies:
    """The adapter versions a fixed-lag run still samples with, on the CPU (a few MB each)."""

    def __init__(self, lag: int):
        self.lag = lag
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def version_for(self, step: int) -> int:
        """The policy version that samples `step`."""
        return max(0, step - 1 - self.lag)

    def record(self, version: int, model) -> None:
        """Keep the adapter after step `version`; forget the versions no later step samples with."""
        from peft import get_peft_model_state_dict

        self.versions[version] = {k: v.detach().to("cpu", copy=True)
                                  for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
        for old in [v for v in self.versions if v < version - self.lag]:
            del self.versions[old]

    @contextlib.contextmanager
    def active(self, model, version: int):
        """The block runs with adapter `version` in the model's LoRA weights (the current ones put back after,
        bit for bit)."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        if version not in self.versions:
            raise KeyError(f"adapter version {version} is not kept (kept: {sorted(self.versions)})")
        current = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
        with torch.no_grad():
            set_peft_model_state_dict(model, self.versions[version], adapter_name="default")
        try:
            yield
        finally:
            with torch.no_grad():
                set_peft_model_state_dict(model, current, adapter_name="default")

    def save(self, folder: Path, step: int) -> None:
        """Write the versions the steps after `step` still sample with (the current one is the checkpoint's)."""
        from safetensors.torch import save_file

        (Path(folder) / FOLDER).mkdir()
        for v in sorted(self.versions):
            if v < step:
                save_file(self.versions[v], str(Path(folder) / FOLDER / f"adapter-v{v}.safetensors"))

    def load(self, folder: Path, step: int, model) -> None:
        """The versions a checkpoint of `step` kept, and its own adapter (already in `model`) as version `step`."""
        from safetensors.torch import load_file

        self.versions = {}
        for path in sorted((Path(folder) / FOLDER).glob("adapter-v*.safetensors")):
            self.versions[int(path.stem.split("-v")[1])] = load_file(str(path))
        self.record(step, model)
        missing = [v for v in range(max(0, step - self.lag), step) if v not in self.versions]
        if missing:
            raise ValueError(f"{Path(folder).name} lacks the adapter versions {missing} that rollout.async_lag "
                             f"{self.lag} samples the next steps with")
