"""TRL's GRPOConfig and SFTConfig as our recipe (docuchat_rl/trl_args.py): every field classified, a field set away
from TRL's default applied or refused by name (generated over the dataclasses), docs/from_trl.md's table the one
the code applies."""

from __future__ import annotations

import re

import pytest

from docuchat_rl.config import ConfigError

from .conftest import ROOT


def _trl_fields(cls) -> list:
    import dataclasses

    return [f for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_every_field_of_trls_config_is_mapped_inert_or_refused(kind):
    """Every field of TRL's GRPOConfig / SFTConfig (its own and TrainingArguments') is in the mapping, the inert set
    or the refused set: a field TRL adds later fails here, never slips through a run unmapped."""
    from trl import GRPOConfig, SFTConfig

    from docuchat_rl import trl_args as t

    cls, table, batch = (GRPOConfig, t.GRPO, t.BATCH) if kind == "grpo" else (SFTConfig, t.SFT, t.SFT_BATCH)
    known = set(table) | set(batch) | t.INERT | t.REFUSED | t.API_FIELDS
    missing = [f.name for f in _trl_fields(cls) if f.name not in known]
    assert not missing, f"{cls.__name__} fields neither mapped, inert nor refused: {missing}"


def _other_value(cls, field):
    """A value of `field` other than TRL's default that TRL itself accepts, or None where none is simple."""
    import enum
    import typing

    default = getattr(cls(output_dir="/tmp/d", use_cpu=True), field.name)
    if isinstance(default, bool):
        return not default
    if isinstance(default, enum.Enum):
        others = [m for m in type(default) if m != default]
        return others[0].value if others else None
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, str) and field.name not in ("output_dir",):
        return default + "x"
    if default is None and "float" in str(field.type) and "int" not in str(field.type):
        return 0.5
    if default is None and "int" in str(field.type):
        return 3
    return None


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_a_field_set_away_from_trls_default_is_applied_or_refused_by_name(kind):
    """Generated over the dataclass: each field set to another value TRL accepts either changes the overrides
    (mapped), changes nothing (inert) or is one ConfigError naming `args.<field>`; nothing else happens."""
    from trl import GRPOConfig, SFTConfig

    from docuchat_rl import trl_args as t

    cls, table = (GRPOConfig, t.GRPO) if kind == "grpo" else (SFTConfig, t.SFT)
    base = t.overrides_of(cls(output_dir="/tmp/d", use_cpu=True))
    tried = mapped = refused = 0
    for f in _trl_fields(cls):
        value = _other_value(cls, f)
        if value is None or f.name in ("output_dir", "use_cpu"):
            continue
        try:
            args = cls(output_dir="/tmp/d", use_cpu=True, **{f.name: value})
        except Exception:  # noqa: BLE001 (TRL refuses the value itself: not a config a user could pass)
            continue
        tried += 1
        try:
            got = t.overrides_of(args)
        except ConfigError as e:
            refused += 1
            named = re.search(r"args\.(\w+)", str(e))
            assert named or "args:" in str(e), (f.name, str(e))
            if named and named.group(1) != f.name:  # (a deprecated alias sets its new field: that one is named)
                default = cls(output_dir="/tmp/d", use_cpu=True)
                assert getattr(args, named.group(1)) != getattr(default, named.group(1)), (f.name, str(e))
            assert f.name not in t.INERT, f"inert field {f.name} refused"
            continue
        if f.name in table or f.name in t.BATCH + t.SFT_BATCH:
            mapped += got != base
        else:
            assert got == base, f"{f.name} changed the recipe though it is not mapped: {got}"
    assert tried > 60 and mapped > 10 and refused > 5, (tried, mapped, refused)




def test_the_docs_table_is_the_mapping_the_api_applies():
    """docs/from_trl.md's GRPOConfig table names every field trl_args maps (and the batch fields and
    reward_weights), and names no GRPOConfig field the code does not map."""
    import dataclasses

    from trl import GRPOConfig

    from docuchat_rl import trl_args as t

    text = (ROOT / "docs" / "from_trl.md").read_text()
    table = text[text.index("| TRL `GRPOConfig` |"):].split("\n\n")[0]
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    named = {w for row in table.splitlines()[2:] for w in re.findall(r"`(\w+)", row.split("|")[1]) if w in fields}
    mapped = set(t.GRPO) | set(t.BATCH) | t.API_FIELDS
    assert mapped - named == set(), f"mapped but not in the table: {sorted(mapped - named)}"
    said_refused = {"generation_kwargs"}  # (the row says the API refuses it and names the key instead)
    assert named - mapped - said_refused == set(), f"in the table but not mapped: {sorted(named - mapped)}"
