"""Config: YAML round trips, --set overrides, and one clear line for every kind of bad input."""

import pytest
import yaml

from docuchat_rl.config import Config, ConfigError, config_from_dict, explain, load_config

from .conftest import ROOT


def test_default_yaml_loads_and_round_trips(tmp_path):
    cfg = load_config(ROOT / "config" / "default.yaml")
    assert cfg.rollout.batch_rows == 64 and cfg.rewards.components[0].name == "correctness"
    p = tmp_path / "resolved.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(p) == cfg


def test_recipes_all_validate():
    for path in sorted((ROOT / "config").glob("*.yaml")):
        load_config(path)


def test_overrides_parse_yaml_values_and_address_rewards_by_name():
    cfg = load_config(None, ["optim.lr=1e-3", "rollout.num_generations=4", "logging.progress=false",
                             "rewards.format.weight=0.5", "rewards.format.params.mode=lenient",
                             "lora.target_modules=[q_proj, v_proj]"])
    assert cfg.optim.lr == 1e-3 and cfg.rollout.num_generations == 4 and cfg.logging.progress is False
    fmt = cfg.rewards.components[1]
    assert (fmt.name, fmt.weight, fmt.params) == ("format", 0.5, {"mode": "lenient"})
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_rewards_list_shorthand_and_index_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rewards:\n  - {name: correctness}\n  - {name: repetition, weight: 0.1, params: {n: 2}}\n")
    cfg = load_config(p, ["rewards.1.params.n=4", "rewards.strict=true"])
    assert cfg.rewards.components[1].params == {"n": 4} and cfg.rewards.strict


BAD = [
    # (overrides, expected message fragment, why)
    (["optim.lrr=1"], "'optim.lrr' is unknown; allowed here: .*lr", "unknown key lists the allowed ones"),
    (["nosuch.key=1"], "'nosuch' is unknown", "unknown section"),
    (["rollout.num_generations=many"], "'rollout.num_generations'.*integer", "wrong type"),
    (["rollout.temperature=0"], "'rollout.temperature'.*greater than 0", "out of range"),
    (["algorithm.scale=mean"], "'algorithm.scale'.*'group', 'batch' or 'none'", "not one of the choices"),
    (["algorithm.name=reinforce"], "'algorithm.name'.*unknown algorithm 'reinforce'; valid: a2c, grpo, ppo",
     "unknown algorithm lists the valid ones"),
    (["rewards.0.name=corectness"], "'rewards.components.0.name'.*registered rewards are",
     "unknown reward lists the registered ones"),
    (["rollout.num_generations=1"], "'rollout.num_generations'.*at least 2", "group size 1 with grpo"),
    (["rollout.max_new_tokens=0"], "'rollout.max_new_tokens'.*greater than or equal to 1",
     "max_new_tokens 0"),
    (["optim.minibatch_size=48"], "optim.minibatch_size: 48 must divide the rollout batch",
     "impossible combination"),
    (["rewards.nosuch.weight=1"], "no entry 'nosuch'; entries are \\['correctness', 'format'\\]",
     "override of an unlisted reward"),
    (["optim.lr"], "expected section.key=value", "malformed override"),
    (["algorithm.name=a2c", "algorithm.num_iterations=2"], "'algorithm.num_iterations': a2c makes a single",
     "a2c with several updates"),
    (["algorithm.name=a2c", "optim.minibatch_size=32"], "'optim.minibatch_size': a2c makes a single update",
     "a2c with minibatches"),
    (["rollout.min_new_tokens=80"], "rollout.min_new_tokens: 80 is more than rollout.max_new_tokens \\(64\\)",
     "min above max new tokens"),
    (["rollout.engine=sglang"], "'rollout.engine'.*'fast', 'hf' or 'vllm'", "unknown rollout engine"),
    (["rollout.correction=token_truncate", "rollout.correction_min=3"],
     "rollout.correction_min \\(3.0\\) must be below rollout.correction_max \\(2.0\\)", "correction bounds"),
    (["algorithm.name=ppo", "algorithm.critic_backbone=own"], "'algorithm.critic_backbone'.*'shared' or 'separate'",
     "unknown critic backbone"),
    (["rollout.sharded_generation=true", "rollout.merge_adapter=true"], "rollout.sharded_generation keeps the weights sharded.*merge_adapter=false",
     "sharded generation with a merged adapter"),
    (["algorithm.delta=2"], None, "two-sided clip with the clipped surrogate (valid)"),
    (["algorithm.surrogate=sapo", "algorithm.delta=2"], "'algorithm.delta' applies to algorithm.surrogate clip, "
     "not sapo", "a knob of another surrogate"),
    (["algorithm.vespo_k_pos=1"], "'algorithm.vespo_k_pos' applies to algorithm.surrogate vespo, not clip",
     "a vespo knob under the clipped surrogate"),
    (["algorithm.delta=0.9"], "'algorithm.delta'.*greater than 1", "a two-sided clip below 1"),
    (["algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.scale=none"],
     "'algorithm.scale' does not apply with multi_objective_aggregation normalize_then_sum", "GDPO's own scaling"),
    (["algorithm.top_entropy_quantile=1.5"], "'algorithm.top_entropy_quantile'.*less than or equal to 1",
     "entropy quantile above 1"),
    (["algorithm.name=ppo", "algorithm.surrogate=cispo"], "'algorithm.surrogate'.*ppo", "a GRPO key under PPO"),
    (["rollout.vllm.gpu_memory_utilization=0.5"], "rollout.vllm applies to rollout.engine vllm, not auto",
     "vLLM settings without the vLLM engine"),
    (["rollout.engine=vllm", "rollout.sharded_generation=true", "rollout.merge_adapter=false"],
     "rollout.engine vllm generates on whole weights", "vLLM with sharded generation"),
    (["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"], None, "vLLM settings with the vLLM engine"),
    (["run.output_dir="], "'run.output_dir': must name a folder", "an empty output folder"),
    (["eval.also={a/b: data/task/test.jsonl}"], "'eval.also': 'a/b' cannot name a held-out set",
     "a held-out set's name with a slash"),
    (["algorithm.critic_lr=0.001"], "'algorithm.critic_lr'.*grpo", "a critic key under GRPO"),
    (["run.output_dir=  "], "'run.output_dir': must name a folder", "a blank output folder"),
    (["sft.source=traces"], "sft.path: source traces reads a run folder", "SFT from traces without a run"),
    (["sft.keep_truncated=true"], "sft.keep_truncated applies to source traces, not answers",
     "keeping cut traces without traces"),
    (["data.difficulty={low: 0.5, high: 0.5}"], "data.difficulty.low .0.5. must be below", "an empty band"),
    (["data.difficulty={}", "rollout.async_lag=1"], "data.difficulty cannot be used with rollout.async_lag",
     "difficulty filtering with a fixed lag"),
    (["sft.source=jsonl", "sft.path=x.jsonl", "sft.answer_template=steps"],
     "sft.answer_template applies to source answers, not jsonl", "a template of another source"),
    (["sft.where=step > 2"], "sft.where applies to source traces, not answers", "an audit filter without traces"),
    (["sft.steps=10", "sft.epochs=2"], "sft.steps and sft.epochs both set", "two lengths for one run"),
    (["sft.output_dir=runs/default"], "sft.output_dir runs/default is run.output_dir", "SFT and RL in one folder"),
    (["sft.source=answers", "sft.answer_template=think_answer"], None, "an SFT section (valid)"),
]


@pytest.mark.parametrize("overrides,message,why", BAD, ids=[b[2] for b in BAD])
def test_bad_config_is_one_clear_line(overrides, message, why):
    if message is None:  # the valid neighbour of a refused combination
        load_config(None, overrides)
        return
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)


def test_every_field_is_documented():
    from docuchat_rl.algorithm_configs import ALGORITHMS

    models = [next(a for a in getattr(s.annotation, "__args__", (s.annotation,)) if a is not type(None))
              for k, s in Config.model_fields.items() if k != "algorithm"]  # (sft: SFTConfig | None)
    for model in models + list(ALGORITHMS.values()):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no doc"
    assert "num_generations = 8  # Completions (G) sampled per prompt" in explain()


# one key of each algorithm that another algorithm does not read
FOREIGN = [
    ("grpo", "kl_in_reward=true"), ("grpo", "vf_clip=0.1"), ("grpo", "n_steps=4"), ("grpo", "critic_backbone=separate"),
    ("ppo", "n_steps=4"), ("ppo", "scale=batch"), ("ppo", "std_epsilon=0.1"),
    ("a2c", "vf_clip=0.1"), ("a2c", "lam=0.9"), ("a2c", "epsilon_high=0.28"), ("a2c", "scale=none"),
]


@pytest.mark.parametrize("algo,assignment", FOREIGN, ids=[f"{a}-{k.split('=')[0]}" for a, k in FOREIGN])
def test_a_key_of_another_algorithm_is_refused_naming_key_and_algorithm(algo, assignment):
    key = assignment.split("=")[0]
    with pytest.raises(ConfigError, match=f"'algorithm.{key}' does not apply to algorithm '{algo}'; its keys are") as e:
        load_config(None, [f"algorithm.name={algo}", f"algorithm.{assignment}"])
    assert "\n" not in str(e.value)


def test_each_algorithm_gets_its_own_config_model():
    from docuchat_rl.algorithm_configs import A2CConfig, GRPOConfig, PPOConfig

    assert type(load_config(None).algorithm) is GRPOConfig  # no name: grpo
    assert type(load_config(None, ["algorithm.name=ppo", "rollout.num_generations=1"]).algorithm) is PPOConfig
    cfg = load_config(ROOT / "config" / "a2c.yaml", ["algorithm.n_steps=8"])
    assert type(cfg.algorithm) is A2CConfig and cfg.algorithm.n_steps == 8
    assert load_config(None, ["algorithm.scale=none"]).algorithm.scale == "none"  # a section without name


def test_explain_lists_the_chosen_algorithms_keys_and_every_choice_keys_values():
    grpo, a2c = explain(load_config(None)), explain(load_config(ROOT / "config" / "a2c.yaml"))
    assert "  scale = 'group'  [group | batch | none]" in grpo and "n_steps" not in grpo
    assert "  multi_objective_aggregation = 'sum_then_normalize'  [sum_then_normalize | normalize_then_sum]" in grpo
    assert "  grouped_decode = 'auto'  [true | false | auto]" in grpo and "  progress = True  #" in grpo
    assert "  n_steps = None" in a2c and "  scale =" not in a2c and "vf_clip" not in a2c


def test_config_explain_runs_without_torch():
    """`docuchat-rl config --explain` in a fresh interpreter imports neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys; from docuchat_rl.cli import main; main(['config', '--explain', '--set', "
            "'algorithm.name=ppo', '--set', 'rollout.num_generations=1']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "  vf_clip = 0.2" in out.stdout and "  lam = 0.95" in out.stdout


def test_auto_switches_are_decided_per_device_and_explicit_values_win():
    """Each speed switch is decided per device as measured (docs/performance.md); a value the recipe sets is
    kept; deciding twice changes nothing."""
    def switches(c):
        return (c.rollout.engine, c.rollout.grouped_decode, c.rollout.merge_adapter, c.optim.share_prompt,
                c.optim.length_buckets, c.lora.fused, c.rollout.generation_batch_size, c.rollout.cuda_graphs)

    cfg = load_config(ROOT / "config/default.yaml")
    cpu, gpu = cfg.for_device("cpu"), cfg.for_device("cuda")
    assert switches(cpu) == ("fast", True, True, True, 4, True, 64, False)
    assert switches(gpu) == ("fast", False, True, False, 1, False, 256, True)
    assert switches(cpu.for_device("cuda")) == switches(cpu)  # (decided once, at the run's start)
    set_ = load_config(ROOT / "config/default.yaml", ["rollout.engine=fast", "optim.length_buckets=2",
                                                       "rollout.grouped_decode=true"]).for_device("cuda")
    assert (set_.rollout.engine, set_.optim.length_buckets, set_.rollout.grouped_decode) == ("fast", 2, True)
    hf = load_config(ROOT / "config/default.yaml", ["rollout.engine=hf"]).for_device("cpu")
    assert hf.rollout.grouped_decode is False  # (the fast loop's switch: off under hf, the decided config valid)
    assert config_from_dict(hf.to_dict()).rollout.grouped_decode is False  # (a checkpoint's run_config reloads)
    graphs = load_config(ROOT / "config/default.yaml", ["rollout.cuda_graphs=true"]).for_device("cuda")
    assert graphs.rollout.engine == "fast"  # (graphs are the fast loop's: auto picks it on a GPU too)
    for override in ("rollout.cuda_graphs=false", "rollout.engine=hf"):  # (without graphs the GPU's sampler is hf)
        plain = load_config(ROOT / "config/default.yaml", [override]).for_device("cuda").rollout
        assert (plain.engine, plain.cuda_graphs) == ("hf", False)
    assert config_from_dict(gpu.to_dict()).rollout.cuda_graphs is True  # (a checkpoint's run_config reloads)
    with pytest.raises(ValueError, match="rollout.cuda_graphs applies to our fast decode loop .* not to rollout.engine hf"):
        load_config(ROOT / "config/default.yaml", ["rollout.cuda_graphs=true", "rollout.engine=hf"])
    sharded = load_config(ROOT / "config/default.yaml", ["rollout.sharded_generation=true"]).for_device("cpu")
    assert sharded.rollout.merge_adapter is False  # (the sharded weights cannot take the merged delta)
    sharded = load_config(ROOT / "config/default.yaml", ["rollout.sharded_generation=true"]).for_device("cuda")
    assert (sharded.rollout.engine, sharded.rollout.cuda_graphs) == ("hf", False)  # (lockstep: no static decode)
    compiled = load_config(ROOT / "config/default.yaml", ["rollout.compile_decode=true"])
    assert compiled.for_device("cuda").rollout.cuda_graphs is True  # (auto graphs on a GPU: the step it compiles)
    with pytest.raises(ConfigError, match="rollout.compile_decode .* auto is off on cpu: set rollout.cuda_graphs=true"):
        compiled.for_device("cpu")
    sharded = load_config(ROOT / "config/default.yaml",
                          ["rollout.compile_decode=true", "rollout.sharded_generation=true"])
    with pytest.raises(ConfigError, match="off on cuda with rollout.sharded_generation"):
        sharded.for_device("cuda")
    for override in ("rollout.cuda_graphs=false", "rollout.engine=hf"):
        with pytest.raises(ValueError, match="rollout.compile_decode compiles the static decode step: it needs"):
            load_config(ROOT / "config/default.yaml", ["rollout.compile_decode=true", override])
        with pytest.raises(ValueError, match="rollout.fused_projections fuses the static decode step's projections"):
            load_config(ROOT / "config/default.yaml", ["rollout.fused_projections=true", override])
    fused = load_config(ROOT / "config/default.yaml", ["rollout.fused_projections=true"])
    assert fused.for_device("cuda").rollout.cuda_graphs is True
    with pytest.raises(ConfigError, match="rollout.fused_projections .* off on cpu: set rollout.cuda_graphs=true"):
        fused.for_device("cpu")


@pytest.mark.parametrize("override,says", [
    ("rollout.async_lag=true", "config key 'rollout.async_lag': must be a number, not true/false (got True)"),
    ("rollout.temperature=false", "config key 'rollout.temperature': must be a number, not true/false"),
    ("algorithm.epsilon_low=true", "config key 'algorithm.epsilon_low': must be a number, not true/false"),
    ("rollout.generation_batch_size=true", "config key 'rollout.generation_batch_size': must be a number"),
    ("optim.lr=.inf", "config key 'optim.lr': Input should be a finite number (got inf)"),
    ("optim.lr=.nan", "config key 'optim.lr': Input should be a finite number (got nan)"),
    ("algorithm.beta=.inf", "config key 'algorithm.beta': Input should be a finite number"),
    ("rewards.format.weight=-.inf", "config key 'rewards.components.1.weight': Input should be a finite number"),
    ("lora.target_modules=[]", "config key 'lora.target_modules': must name at least one module (or all-linear)"),
])
def test_a_number_key_refuses_true_false_and_infinities_and_lora_needs_a_target(override, says):
    """pydantic alone reads `true` as 1 and accepts inf and nan (`optim.lr: .inf` wrote all-NaN checkpoints
    before the run stopped); an empty target list reached peft as a traceback."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    load_config(None, ["lora.fused=true", "rollout.grouped_decode=false", "optim.lr=1e-3"])  # switches take bools


def test_a_recipe_that_is_not_utf8_is_one_line_naming_its_line(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(b"run:\n  steps: 3\n  output_dir: caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert str(e.value) == f"{recipe}: line 3 is not UTF-8 text; save the recipe as UTF-8"


# ------------------------------------------------ classes of bad input, with generated inputs (issue 55)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_RESOLVED = Config().to_dict()
_KEYS = sorted((section, key) for section, body in _RESOLVED.items() if isinstance(body, dict) for key in body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(_KEYS), whole_section=st.booleans())
def test_a_key_or_section_written_twice_in_a_recipe_is_refused_naming_its_lines(tmp_path, where, whole_section):
    """Any key of any section, or any whole section, written twice: yaml.safe_load would keep the second and
    drop the first without a word; the loader refuses it, naming both lines."""
    import json

    section, key = where
    body = _RESOLVED[section]
    value = json.dumps(_RESOLVED[section][key])  # (JSON is YAML's flow style)
    rows = [f"{section}:", *(f"  {k}: {json.dumps(v)}" for k, v in body.items())]
    rows += [f"{section}:", f"  {key}: {value}"] if whole_section else [f"  {key}: {value}"]
    p = tmp_path / "twice.yaml"
    p.write_text("\n".join(rows) + "\n")
    name = section if whole_section else key
    with pytest.raises(ConfigError, match=rf"twice.yaml: line \d+: key '{name}' is written twice in one mapping "
                                          rf"\(first on line \d+\)"):
        load_config(p)
    p.write_text("\n".join(rows[:-1 - whole_section]) + "\n")  # (written once, the same recipe loads)
    load_config(p)


def test_a_key_written_twice_inside_a_set_value_is_refused():
    with pytest.raises(ConfigError, match="--set rewards: line 1: key 'name' is written twice"):
        load_config(None, ["rewards=[{name: correctness, name: format}]"])


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 12), lag=st.integers(0, 14), every=st.one_of(st.none(), st.integers(1, 14)))
def test_a_lag_or_an_evaluation_period_longer_than_the_run_is_refused(steps, lag, every):
    """A setting that cannot take effect in this run is an error when the run starts, never accepted: a fixed
    lag no shorter than run.steps (every step would sample with the initial adapter), eval.every past the
    last step."""
    sets = [f"run.steps={steps}", f"rollout.async_lag={lag}", f"eval.every={'null' if every is None else every}"]
    cfg = load_config(None, sets)  # (it loads: a finished run's recipe is read again by eval, replay, rescore)
    if lag >= steps and lag:
        with pytest.raises(ConfigError, match=rf"rollout.async_lag {lag} is not shorter than the run"):
            cfg.check_run()
    elif every is not None and every > steps:
        with pytest.raises(ConfigError, match=rf"eval.every {every} is longer than the run"):
            cfg.check_run()
    else:
        cfg.check_run()
        assert (cfg.rollout.async_lag, cfg.eval.every, cfg.run.steps) == (lag, every, steps)


def test_explain_is_one_line_a_key():
    """A doc that quotes a newline ("\\n\\n" of model.stop_tokens) shows it escaped: every line is a key or a section."""
    import re

    lines = explain().splitlines()
    assert all(re.match(r"^\s*\w+( = |:)", line) for line in lines), [x for x in lines if not re.match(r"^\s*\w+( = |:)", x)]
    assert any('"\\n\\n"' in line for line in lines if "stop_tokens" in line)


@pytest.mark.parametrize("sets,mode", [
    ([], None),
    (["rollout.async_lag=1"], "token_truncate"),  # decoupled PPO's default under a fixed lag
    (["rollout.correction=sequence_mask"], "sequence_mask"),
    (["rollout.async_lag=1", "rollout.correction=token_mask"], "token_mask"),
])
def test_the_sampler_correction_in_effect_is_decided_in_one_place(sets, mode):
    """The learner is handed `rollout.correction_in_effect` (run.py): the default under a fixed lag is decided
    by the config, not by the learner reading rollout.async_lag."""
    assert load_config(None, ["run.steps=5", *sets]).rollout.correction_in_effect == mode
