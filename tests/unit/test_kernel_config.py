"""KernelConfig: its defaults (seeded by fulcrum.envs), its dict/JSON form and the
``--kernel-config`` flag."""

from __future__ import annotations

import dataclasses

import pytest

from fulcrum.config import (
    AttentionKernelConfig,
    KernelConfig,
    PdlConfig,
    describe_kernel_config,
)
from fulcrum.engine.arg_utils import EngineArgs, parse_kernel_config
from fulcrum.entrypoints.cli import build_parser


def test_environment_seeds_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    base = KernelConfig()
    monkeypatch.setenv("FULCRUM_PDL", "0")
    monkeypatch.setenv("FULCRUM_GEMV_MAX_M", "4")
    monkeypatch.setenv("FULCRUM_DISABLE_TRITON_KERNELS", "1")
    monkeypatch.setenv("FULCRUM_GEMV_CONFIG", "bf16=8,1024,2;fp8=4,512,4")
    kc = KernelConfig()
    assert base.pdl.enabled and not kc.pdl.enabled
    assert kc.pdl.pre_release == base.pdl.pre_release  # unset: its own default
    assert (base.gemv.max_m, kc.gemv.max_m) == (1, 4)
    assert base.triton_kernels and not kc.triton_kernels
    assert kc.gemv.launch == {"bf16": (8, 1024, 2), "fp8": (4, 512, 4)}
    # a value given explicitly wins over the environment
    assert KernelConfig.from_dict({"pdl": {"enabled": True}}).pdl.enabled
    monkeypatch.setenv("FULCRUM_ARGMAX_KERNEL", "yes")
    with pytest.raises(ValueError, match="FULCRUM_ARGMAX_KERNEL"):
        KernelConfig()


def test_from_dict_and_replace_keep_what_is_not_named() -> None:
    kc = KernelConfig.from_dict({"pdl": {"early_max_waves": 3}, "fused_sampler": False})
    assert kc.pdl == PdlConfig(early_max_waves=3) and not kc.fused_sampler
    assert kc.attention == AttentionKernelConfig() and kc.argmax_kernel
    kc2 = kc.replace(pdl={"enabled": False}, attention={"max_splits": 8})
    assert (kc2.pdl.enabled, kc2.pdl.early_max_waves, kc2.attention.max_splits) == (False, 3, 8)
    assert kc2.attention.order_min_reqs == 64 and not kc2.fused_sampler
    assert dataclasses.replace(kc2, fused_sampler=True).fused_sampler
    assert hash(kc) != hash(kc2)  # frozen and hashable, the launch table aside


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"pdl_enabled": False}, "unknown key 'pdl_enabled'"),
        ({"pdl": {"enable": False}}, "unknown key 'pdl.enable'"),
        ({"gemv": {"max_m": "1"}}, "gemv.max_m: expected int"),
        ({"argmax_kernel": 0}, "argmax_kernel: expected bool"),
        ({"attention": {"max_splits": 64}}, "max_splits must be in"),
        ({"gemv": {"launch": {"bf16": [4, 1024]}}}, "gemv.launch"),
        ({"pdl": True}, "kernel_config.pdl: expected an object"),
    ],
)
def test_bad_values_raise_naming_the_field(values: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_kernel_config(values)


def test_every_switch_is_described() -> None:
    rows = list(describe_kernel_config())
    names = [name for name, *_ in rows]
    assert "pdl.enabled" in names and "attention.order_min_reqs" in names
    assert all(doc for _, _, doc, _ in rows)
    envs = {env for *_, env in rows if env}
    assert len(envs) == 14  # every FULCRUM_* switch seeds exactly one field


def test_kernel_config_flag_parses_json_and_names_a_bad_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "--prompt", "x", "--kernel-config", '{"gemv": {"fuse_silu": false}}']
    )
    engine_args = EngineArgs.from_cli_args(args)
    kc = parse_kernel_config(engine_args.kernel_config)
    assert not kc.gemv.fuse_silu and kc.gemv.fuse_rope
    args = parser.parse_args(["generate", "--prompt", "x"])
    assert parse_kernel_config(EngineArgs.from_cli_args(args).kernel_config) == KernelConfig()
    for bad, why in (('{"gemv": {"fuse_sliu": false}}', "gemv.fuse_sliu"), ("{oops", "JSON")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["generate", "--prompt", "x", "--kernel-config", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--kernel-config" in err and why in err


def test_engine_args_take_a_dict_and_reject_unknown_keys() -> None:
    from fulcrum import LLM

    with pytest.raises(ValueError, match="unknown key 'no_such_switch'"):
        LLM(device="cpu", kernel_config={"no_such_switch": True})


def test_engine_args_hold_the_user_facing_defaults() -> None:
    """EngineConfig's resolved fields have no defaults of their own (one place each)."""
    from fulcrum.config import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in ("enforce_eager", "async_scheduling", "piecewise_graph_max_tokens"):
        assert fields[name].default is dataclasses.MISSING
    assert "extra" not in fields
    args = EngineArgs()
    assert (args.enforce_eager, args.async_scheduling, args.piecewise_graph_max_tokens) == (
        False,
        "auto",
        1024,
    )
