"""Worst-case time per call of each reward on 2,000-character completions of several kinds.

    python scripts/reward_timing.py [--repeats 20]

Prints, per reward, the slowest per-completion time (math-verify's parse cache cleared before
every call) over the kinds (English prose, equations, mixed
languages, LaTeX and code, degenerate repetition, random Unicode), after a warm-up call that pays
one-off costs (imports, lingua's model loading), which is reported separately.
"""

from __future__ import annotations

import argparse
import random
import time

from rewards import build_reward
from rewards.correctness import _parse

KINDS = {
    "prose": "First, we add the apples together. Then we count all of them again carefully. ",
    "equations": "12 + 7 = 19\n19 * 3 = 57\n57 - 4 = 53\n",
    "mixed": "First we add the apples. Ensuite nous comptons les pommes. 然后我们再数一遍。 ",
    "latex_code": "We get $\\frac{3}{4} + x = 7$ and ```python\nprint(3 + 4)\n``` so \\boxed{7} ",
    "repetition": "the answer is the answer is ",
}
REWARDS = [("correctness", {}), ("format", {}), ("tag_count", {}), ("reasoning_steps", {}), ("repetition", {}),
           ("language", {}), ("length", {"max_len": 512}), ("length", {"shape": "overlong", "max_len": 512})]


def texts(n_chars: int = 2000) -> dict[str, str]:
    out = {k: "<think>" + (v * (n_chars // len(v) + 1))[:n_chars - 40] + "</think><answer>7</answer>"
           for k, v in KINDS.items()}
    out["latex_code"] = out["latex_code"].replace("<answer>7</answer>",
                                                  "<answer>\\frac{14}{2} + \\sqrt{4} - 2</answer>")
    rng = random.Random(0)
    out["random_unicode"] = "".join(chr(rng.randrange(32, 0x3000)) for _ in range(n_chars))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    samples = texts()
    print(f"{'reward':<28}{'first call (s)':>16}{'worst per call (ms)':>22}  slowest kind")
    for name, params in REWARDS:
        r = build_reward(name, params)
        t0 = time.perf_counter()
        r(["Q"], [samples["prose"]], answer=["7"], completion_tokens=[500])
        first = time.perf_counter() - t0
        worst, worst_kind = 0.0, ""
        for kind, text in samples.items():
            spent = 0.0
            for _ in range(a.repeats):
                _parse.cache_clear()  # worst case: no math-verify parse is cached
                t0 = time.perf_counter()
                r(["Q"], [text], answer=["7"], completion_tokens=[500])
                spent += time.perf_counter() - t0
            per = spent / a.repeats * 1000
            if per > worst:
                worst, worst_kind = per, kind
        label = name + ("" if not params else f" {params.get('shape', '')}".rstrip())
        print(f"{label:<28}{first:>16.3f}{worst:>22.2f}  {worst_kind}")


if __name__ == "__main__":
    main()
