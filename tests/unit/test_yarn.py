"""YaRN at inference (``--rope-scaling yarn``): the project's logits past the trained length equal those of
MiniMind's formula, written out again here from MiniMind's ``precompute_freqs_cis`` (model/model_minimind.py
@ d65ef2c) in float64 scalar arithmetic, and the switch reaches the model from generate/chat/serve's flags."""
from __future__ import annotations

import math

import pytest
import torch

from minimind_ray.cli import build_parser, main
from minimind_ray.config import ModelConfig
from minimind_ray.generate_verb import rope_scaling_of
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store.pth import save_pth
from minimind_ray.store.weights import build_inference_model, rope_scaling_spec, set_rope_scaling

torch.set_num_threads(2)

ORIG, FACTOR, T = 32, 4.0, 96  # a model "trained" to 32 positions, asked about 96


def minimind_yarn_tables(head_dim: int, positions: int, base: float, factor: float, orig: int,
                         beta_fast: float = 32.0, beta_slow: float = 1.0, attention_factor: float = 1.0,
                         table_len: int = 32768):
    """cos, sin (positions, head_dim) by MiniMind's YaRN: each frequency pair i of the RoPE base is slowed to
    f_i * ((1 - g_i) + g_i / factor), where g_i rises linearly from 0 to 1 between the pair that turns
    beta_fast times over the original context (floored, at least 0) and the one that turns beta_slow times
    (ceiled, at most the last pair); only when the table is longer than the original context. Both halves of
    a head get the same angles (HF's rotate_half layout), times attention_factor."""
    half = head_dim // 2

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times in `orig`
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    first, last = max(math.floor(pair_turning(beta_fast)), 0), min(math.ceil(pair_turning(beta_slow)), half - 1)
    freqs = []
    for i in range(half):
        f = base ** (-2 * i / head_dim)
        if table_len > orig:
            g = min(max((i - first) / max(last - first, 0.001), 0.0), 1.0)
            f *= (1 - g) + g / factor
        freqs.append(f)
    cos = [[math.cos(p * f) * attention_factor for f in freqs] * 2 for p in range(positions)]
    sin = [[math.sin(p * f) * attention_factor for f in freqs] * 2 for p in range(positions)]
    return torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)


def _reference_logits(model, cos, sin, ids):
    """The same weights with the reference tables in place of the model's own."""
    ref = build_model(model.cfg)
    ref.load_state_dict(model.state_dict())
    ref.model.freqs_cos[: cos.shape[0]] = cos.float()
    ref.model.freqs_sin[: sin.shape[0]] = sin.float()
    with torch.no_grad():
        return ref.eval()(ids).logits


@pytest.fixture(scope="module", params=["tiny", "tiny3"])  # minimind2 (no QK-norm) and minimind-3 layouts
def pth(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("yarn") / f"{request.param}.pth"
    save_pth(build_model(ModelConfig(**preset_values(request.param)), seed=5), str(path))
    return path


def test_yarn_logits_past_the_trained_length_equal_minimind_formula(pth):
    spec = rope_scaling_spec("yarn", FACTOR, ORIG)
    model, _ = build_inference_model(str(pth), rope_scaling=spec)
    plain, _ = build_inference_model(str(pth))
    c = model.cfg
    cos, sin = minimind_yarn_tables(c.head_dim, T, c.rope_theta, FACTOR, ORIG)
    table_diff = max((model.model.freqs_cos[:T].double() - cos).abs().max().item(),
                     (model.model.freqs_sin[:T].double() - sin).abs().max().item())
    assert table_diff < 1e-6, table_diff
    ids = torch.randint(3, 6400, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, unscaled = model(ids).logits, plain(ids).logits
    want = _reference_logits(model, cos, sin, ids)
    diff = (ours - want).abs().max().item()
    assert diff < 1e-4, diff  # measured: ~1e-6 (float32 tables vs float64 rounded to float32)
    # the control: YaRN moves the logits, most past the trained length, so the switch is not a no-op
    moved = (ours - unscaled).abs()
    assert moved[:, ORIG:].max().item() > 100 * max(diff, 1e-6), moved[:, ORIG:].max().item()
    assert model.cfg.inference_rope_scaling and model.rope_scaling["factor"] == FACTOR
    print(f"\nYaRN {c.preset}: table max|diff| {table_diff:.2e}, logits max|diff| {diff:.2e} "
          f"(plain RoPE vs YaRN past position {ORIG}: {moved[:, ORIG:].max().item():.2e})")


def test_minimind_default_yarn_and_the_config_switch_build_the_same_tables():
    """--rope-scaling yarn with no numbers is MiniMind's inference_rope_scaling (16 over 2048): the same table
    as a model configured with it, equal to the formula out to 4096 positions (float32 angles: ~1e-4 there)."""
    cfg = ModelConfig(**preset_values("tiny"))
    switched = set_rope_scaling(build_model(cfg, seed=1), rope_scaling_spec("yarn"))
    configured = build_model(ModelConfig(**{**preset_values("tiny"), "inference_rope_scaling": True}), seed=1)
    assert torch.equal(switched.model.freqs_cos, configured.model.freqs_cos)
    assert torch.equal(switched.model.freqs_sin, configured.model.freqs_sin)
    cos, _ = minimind_yarn_tables(cfg.head_dim or 16, 4096, cfg.rope_theta, 16.0, 2048)
    assert (switched.model.freqs_cos[:4096].double() - cos).abs().max().item() < 1e-3
    # and `none` takes a recorded YaRN off again: the plain table, bit for bit
    off = set_rope_scaling(configured, rope_scaling_spec("none"))
    assert torch.equal(off.model.freqs_cos, build_model(cfg, seed=1).model.freqs_cos)
    assert not off.cfg.inference_rope_scaling and off.rope_scaling is None


@pytest.mark.parametrize("verb", ["generate", "chat", "serve"])
def test_every_inference_verb_takes_the_switch_with_minimind_names(verb):
    p = build_parser()
    head = {"generate": ["generate", "--weights", "w.pth", "--prompt", "hi"], "chat": ["chat", "--weights", "w.pth"],
            "serve": ["serve", "w.pth"]}[verb]
    args = p.parse_args(head + ["--rope-scaling", "yarn", "--factor", "4", "--original-max-position-embeddings", "32"])
    assert rope_scaling_of(args) == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
    assert rope_scaling_of(p.parse_args(head)) is None  # default: as the weights record
    assert rope_scaling_of(p.parse_args(head + ["--rope-scaling", "none"])) == {"type": "none"}


@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize("bad,message", [
    (["--rope-scaling", "ntk"], "--rope-scaling: 'ntk' is not one of yarn, none"),
    (["--factor", "4"], "--factor/--original-max-position-embeddings need --rope-scaling yarn"),
    (["--rope-scaling", "yarn", "--factor", "0.5"], "--factor: must be >= 1"),
    # refused by set_rope_scaling on the loaded model: the flag reaches the model the verb builds
    (["--rope-scaling", "yarn", "--original-max-position-embeddings", "40000"], "is not below the model's"),
])
def test_bad_rope_scaling_flags_exit_2_naming_the_flag(capsys, pth, verb, bad, message):
    from tests.conftest import cli_stderr

    head = ["--prompt", "hi"] if verb == "generate" else []
    code = main([verb, "--weights", str(pth), "--tokenizer", "minimind2", *head, *bad])
    err = cli_stderr(capsys).splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_serve_carries_the_switch_to_the_replicas_model(pth):
    """serve: the flags become ServeOptions.rope_scaling (the dict each replica receives), and the replica's
    loader builds the YaRN model from it."""
    from minimind_ray.serve.serve_verb import options_from_args
    from minimind_ray.serve.model_io import load_served_model

    args = build_parser().parse_args(["serve", str(pth), "--tokenizer", "minimind2", "--rope-scaling", "yarn",
                                      "--factor", str(FACTOR), "--original-max-position-embeddings", str(ORIG)])
    args.rope_scaling = rope_scaling_of(args)  # what serve/serve_verb.py:run does before options_from_args
    opts = options_from_args(args)
    assert opts.rope_scaling["type"] == "yarn" and opts.rope_scaling["factor"] == FACTOR
    served = load_served_model(opts.weights, tokenizer=opts.tokenizer, rope_scaling=opts.rope_scaling)
    want, _ = build_inference_model(str(pth), rope_scaling=rope_scaling_spec("yarn", FACTOR, ORIG))
    assert torch.equal(served.model.model.freqs_cos, want.model.freqs_cos)
    plain = load_served_model(opts.weights, tokenizer=opts.tokenizer)
    assert not torch.equal(plain.model.model.freqs_cos, want.model.freqs_cos)
