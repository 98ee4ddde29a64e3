"""LoRA: injection, freezing, MiniMind key layout, save/load, merge."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from minimind_ray.config import ModelConfig
from minimind_ray.model.config import LoRAConfig
from minimind_ray.model.lora import (LoRALinear, apply_lora, freeze_base, load_lora, lora_state_dict, merge_lora,
                                     save_lora)
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values

torch.set_num_threads(2)


def lora_model(preset="tiny", **lora):
    m = build_model(ModelConfig(**preset_values(preset)), seed=0)
    names = apply_lora(m, LoRAConfig(**{"rank": 4, **lora}))
    return m, names


def perturb_adapters(m, seed=1):
    """B starts at zero (adapter = identity); give it values so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, LoRALinear):
                mod.lora.B.weight.copy_(torch.randn(mod.lora.B.weight.shape, generator=g) * 0.05)


def test_square_targets_and_minimind_keys():
    """MiniMind adapts every square nn.Linear: in tiny (h = nh*hs = 64) that is q_proj and o_proj."""
    m, names = lora_model()
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "o_proj")]
    sd = lora_state_dict(m)
    assert list(sd) == [f"{n}.lora.{ab}.weight" for n in names for ab in ("A", "B")]
    assert sd["model.layers.0.self_attn.q_proj.lora.A.weight"].shape == (4, 64)  # A: in -> r
    assert sd["model.layers.0.self_attn.q_proj.lora.B.weight"].shape == (64, 4)  # B: r -> out
    assert torch.count_nonzero(sd["model.layers.0.self_attn.q_proj.lora.B.weight"]) == 0
    # base keys unchanged: the adapted module still owns `.weight`
    assert "model.layers.0.self_attn.q_proj.weight" in m.state_dict()


def test_suffix_targets_and_alpha_scale():
    m, names = lora_model(targets=["v_proj"], alpha=8.0)
    assert names == ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj"]
    assert m.model.layers[0].self_attn.v_proj.scale == 2.0  # alpha / rank
    with pytest.raises(ValueError, match="match no nn.Linear"):
        apply_lora(build_model(ModelConfig(**preset_values("tiny")), seed=0), LoRAConfig(targets=["nope"]))


def test_new_adapters_leave_the_output_unchanged():
    base = build_model(ModelConfig(**preset_values("tiny")), seed=0).eval()
    m, _ = lora_model()
    x = torch.randint(0, 6400, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x).logits, base(x).logits, atol=0, rtol=0)


def test_only_lora_trains_and_base_stays_bitwise_equal():
    m, _ = lora_model("tiny3")
    freeze_base(m)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
    base_before = {k: v.clone() for k, v in m.state_dict().items() if ".lora." not in k}
    lora_before = {k: v.clone() for k, v in lora_state_dict(m).items()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    m.train()
    for _ in range(3):
        x = torch.randint(0, 6400, (2, 8))
        loss = torch.nn.functional.cross_entropy(m(x).logits.flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for k, v in m.state_dict().items():
        if ".lora." not in k:
            assert torch.equal(v, base_before[k]), k
    assert any(not torch.equal(v, lora_before[k]) for k, v in lora_state_dict(m).items())


@pytest.mark.parametrize("alpha", [None, 8.0])
def test_merge_equals_base_plus_lora(alpha):
    m, _ = lora_model("tiny3", alpha=alpha)
    perturb_adapters(m)
    m.eval()
    x = torch.randint(0, 6400, (2, 10))
    with torch.no_grad():
        before = m(x).logits
        merged = merge_lora(m)
        after = merged(x).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    assert not any(isinstance(mod, LoRALinear) for mod in merged.modules())
    assert all(type(mod) is nn.Linear for n, mod in merged.named_modules() if n.endswith(("q_proj", "o_proj")))
    fresh = build_model(ModelConfig(**preset_values("tiny3")), seed=0)
    assert list(merged.state_dict()) == list(fresh.state_dict())  # MiniMind's base keys only


def test_save_load_round_trip(tmp_path):
    m, _ = lora_model()
    perturb_adapters(m)
    path = tmp_path / "lora_identity_64.pth"
    save_lora(m, str(path))
    sd = torch.load(path, weights_only=True)
    assert list(sd) == list(lora_state_dict(m)) and all(v.dtype == torch.float16 for v in sd.values())
    other, _ = lora_model()
    load_lora(other, str(path))
    for k, v in lora_state_dict(other).items():
        assert torch.equal(v, sd[k].float()), k
    load_lora(other, {f"module.{k}": v for k, v in sd.items()})  # DDP prefix tolerated, as in MiniMind
    with pytest.raises(KeyError, match="no matching adapter"):
        load_lora(other, {**sd, "model.layers.0.mlp.up_proj.lora.A.weight": torch.zeros(4, 64)})


def test_adapted_model_pickles_and_deep_copies():
    """No rebound `forward` closures: the model pickles (Ray) and deep-copies (frozen DPO reference)."""
    m, _ = lora_model()
    perturb_adapters(m)  # with B = 0 a copy that lost its adapters would give the same logits
    base = build_model(ModelConfig(**preset_values("tiny")), seed=0).eval()
    x = torch.randint(0, 6400, (1, 6))
    clone = pickle.loads(pickle.dumps(m))
    with torch.no_grad():
        ours = m.eval()(x).logits
        assert (ours - base(x).logits).abs().max() > 1e-3  # the adapters move the output
        torch.testing.assert_close(clone.eval()(x).logits, ours, atol=0, rtol=0)
        torch.testing.assert_close(copy.deepcopy(m)(x).logits, ours, atol=0, rtol=0)


@pytest.mark.parametrize("meta_records_them", [True, False],
                         ids=["meta.json's adapters", "written before: its section"])
def test_a_lora_checkpoint_loads_with_the_adapters_its_stage_put_on_the_model(tmp_path, meta_records_them):
    """A LoRA run's checkpoint loads (export, generate, serve, a next stage's init_from) with the adapters its stage's
    record says it put on the model (alpha, targets), recorded in meta.json; a checkpoint written before meta.json held
    them, with its stage's own section. Read off the tensors alone they would be rank 4 on every square projection at
    scale 1: the v_proj adapters would not load, and alpha 8 would be lost."""
    import dataclasses

    from minimind_ray.config import RunConfig, to_dict
    from minimind_ray.engine.state import RNGState
    from minimind_ray.stages import STAGES
    from minimind_ray.store import checkpoint as ck
    from minimind_ray.store.weights import build_inference_model

    lora = LoRAConfig(rank=4, alpha=8.0, targets=["v_proj"])
    cfg = RunConfig(model=ModelConfig(**preset_values("tiny")))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stage="lora", lora=lora))
    assert STAGES["lora"].adapters(cfg) == lora and STAGES["sft"].adapters(cfg) is None  # the record says so
    m, _ = lora_model(targets=["v_proj"], alpha=8.0)
    perturb_adapters(m)
    d = tmp_path / "run" / "checkpoint_000000"
    ck.write_rank_files(d, 0, RNGState().state_dict())
    ck.write_shared_files(d, model_state=m.state_dict(), train_state={}, meta=ck.CheckpointMeta(
        step=1, epoch=0, data_state={}, world_size=1, stage="lora", total_steps=1, config=to_dict(cfg),
        prepared_dir="/nowhere", adapters=dataclasses.asdict(lora) if meta_records_them else None))
    loaded, _ = build_inference_model(str(d))
    x = torch.randint(0, 6400, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, merge_lora(copy.deepcopy(m))(x).logits)
