"""optim=adamw and optim=muon: which optimizer each parameter of every kind goes to, Muon's fused
weights updated per matrix exactly as torch.optim.Muon updates separate ones, one optimizer whose
state resumes exactly, each schedule's learning rate against its formula, and the settings' checks."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.optim._muon as torch_muon
from conftest import compose_config
from kinds import model_rows
from omegaconf import OmegaConf
from torch import nn

from lm.attention.additive import AdditiveAttention
from lm.attention.gated_delta import DeltaRuleLayer
from lm.attention.mla import LatentAttention
from lm.attention.projections import GroupedQKV, qkv_rows
from lm.config.optim import optim_settings
from lm.config.train import TrainRun
from lm.model.config import ModelConfig
from lm.model.transformer import Transformer
from lm.training.muon import MuonAdamW, SplitMuon, newton_schulz
from lm.training.optim import (
    MuonConfig,
    OptimConfig,
    apply_settings,
    build_optimizer,
    declarations,
    lr_multiplier,
    ns_dtype,
    placement,
    schedule_of,
)
from lm.training.settings import check_run_settings
from lm.util import hardware
from lm.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
KINDS = model_rows()  # name -> (attention, n_kv_head): every registered kind's settings and the hybrids


def kind_model(name: str, tied: bool = False) -> Transformer:
    attention, n_kv_head = KINDS[name]
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=48,
                                   max_seq_len=16, attention=attention, short_conv=3, tie_embeddings=tied))


# ---------------------------------------------------------------------------- Muon per matrix


def grads_for_steps(shape, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_a_fused_weight_moves_as_torch_muon_moves_its_matrices_apart(adjust_lr, nesterov):
    rows = qkv_rows(4, 2, 6)  # Q (24 rows), K (12), V (12) of a GQA projection from 16 features
    fused = nn.Parameter(torch.randn(sum(rows), 16, generator=torch.Generator().manual_seed(0)))
    apart = [nn.Parameter(block.clone()) for block in fused.detach().split(rows)]
    settings = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust_lr}
    split = SplitMuon([fused], fused_rows={fused: rows}, **settings)
    reference = torch.optim.Muon(apart, **settings)
    whole_weight = nn.Parameter(fused.detach().clone())
    whole = torch.optim.Muon([whole_weight], **settings)
    for grad in grads_for_steps(fused.shape, 4):  # momentum carries over the steps
        fused.grad, whole_weight.grad = grad.clone(), grad.clone()
        for p, block in zip(apart, grad.split(rows), strict=True):
            p.grad = block.clone()
        split.step(), reference.step(), whole.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in apart]), rtol=0, atol=0)
    buffers = torch.cat([reference.state[p]["momentum_buffer"] for p in apart])
    torch.testing.assert_close(split.state[fused]["momentum_buffer"], buffers, rtol=0, atol=0)
    # Orthogonalising the stack whole is another update: the split is what made them equal.
    assert (fused - whole_weight).abs().max() > 1e-3


def test_rows_that_do_not_cut_the_weight_are_refused():
    weight = nn.Parameter(torch.randn(10, 4))
    with pytest.raises(ValueError, match=r"rows \(4, 4\) do not cut a fused weight of 10 rows"):
        SplitMuon([weight], fused_rows={weight: (4, 4)})


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=["tall", "wide"])
def test_newton_schulz_in_bf16_is_torch_muons_own_bit_for_bit(shape):
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    ours = newton_schulz(grad, coefficients, 5, 1e-7, torch.bfloat16)
    torch.testing.assert_close(ours, torch_muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7),
                               rtol=0, atol=0)
    # In float32 the same iteration lands within float32's rounding of its float64 value.
    exact = newton_schulz(grad.double(), coefficients, 5, 1e-7, torch.float64)
    torch.testing.assert_close(newton_schulz(grad, coefficients, 5, 1e-7, torch.float32).double(), exact,
                               rtol=0, atol=1e-5)
    assert (ours.double() - exact).abs().max() > 1e-4  # bf16's rounding, which float32 avoids


def test_a_float32_newton_schulz_step_moves_as_torch_muon_within_bf16_rounding():
    weight = nn.Parameter(torch.randn(24, 16, generator=torch.Generator().manual_seed(0)))
    twin = nn.Parameter(weight.detach().clone())
    ours, reference = SplitMuon([weight], ns_dtype="float32", lr=0.02), torch.optim.Muon([twin], lr=0.02)
    own = torch_muon._zeropower_via_newtonschulz
    for grad in grads_for_steps(weight.shape, 3):
        weight.grad, twin.grad = grad.clone(), grad.clone()
        ours.step(), reference.step()
    assert torch_muon._zeropower_via_newtonschulz is own  # the step gave torch its function back
    moved = (twin - weight.detach()).abs().max()
    assert 0 < moved < 2e-3, moved  # 3 steps of lr 0.02, each update's entries rounded to bf16 or not


@pytest.mark.parametrize("bf16_cpu, expected", [(True, "bfloat16"), (False, "float32")])
def test_ns_dtype_auto_is_bfloat16_only_where_bf16_matmuls_are_fast(monkeypatch, bf16_cpu, expected):
    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: bf16_cpu)
    assert ns_dtype("auto", torch.device("cpu")) == expected
    assert ns_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert ns_dtype("float32", torch.device("cuda")) == "float32"
    optimizer = build_optimizer(kind_model("gated_delta"), MuonConfig())
    assert optimizer.muon.ns_dtype == expected


# ---------------------------------------------------------------------------- placement, every kind


@pytest.mark.parametrize("name", list(KINDS))
def test_every_2d_parameter_of_every_kind_is_a_linear_weight_or_declared_and_placed_so(name):
    model = kind_model(name)
    placed = placement(model)
    groups = [placed.muon, placed.adamw, placed.adamw_no_decay]
    assert sorted(n for g in groups for n in g) == sorted(n for n, _ in model.named_parameters())  # each once
    linear = {f"{prefix}.weight" for prefix, m in model.named_modules() if isinstance(m, nn.Linear)}
    declared, fused = set(), {}
    for prefix, module in model.named_modules():
        names, rows = declarations(module)
        declared.update(f"{prefix}.{n}".lstrip(".") for n in names)
        fused.update({f"{prefix}.{n}".lstrip("."): r for n, r in rows.items()})
    for n, p in model.named_parameters():
        if p.dim() == 2:
            assert n in linear or n in declared, n
    assert set(placed.muon) == {n for n in linear - declared if n != "head.weight"}
    names = {n for n, _ in model.named_parameters()}  # a declared parameter may be absent (gated delta's conv off)
    assert declared & names - {"embed.weight"} <= set(placed.adamw)
    assert {"embed.weight", "head.weight"} <= declared and "embed.weight" in placed.adamw_no_decay
    assert all(p.dim() < 2 for n, p in placed.adamw_no_decay.items() if n != "embed.weight")
    assert placed.rows == fused and all(sum(r) == placed.muon[n].shape[0] for n, r in fused.items())
    for prefix, module in model.named_modules():  # what each layer kind declares, spelled out
        at = f"{prefix}."
        if isinstance(module, (GroupedQKV, DeltaRuleLayer)):
            assert placed.rows[at + "qkv.weight"] == qkv_rows(module.n_head, module.n_kv_head, module.head_dim)
        if isinstance(module, DeltaRuleLayer):  # gated delta's layer and KDA's
            assert module.conv is None or at + "conv" in placed.adamw
            assert {at + "A_log", at + "dt_bias", at + "out_norm"} <= set(placed.adamw_no_decay)
        if isinstance(module, AdditiveAttention):
            assert {at + "score", at + "score_bias"} <= set(placed.adamw)
        if isinstance(module, LatentAttention):  # MLA's projections, and DSA's indexer's beside them
            assert {at + n for n, m in module.named_modules() if isinstance(m, nn.Linear)} == {
                n.removesuffix(".weight") for n in placed.muon if n.startswith(at)}
        if prefix.endswith(".mlp"):
            assert placed.rows[at + "gate_up.weight"] == (48, 48)
        if prefix.endswith(".short_conv"):
            assert at + "weight" in placed.adamw


def test_a_tied_head_is_the_embedding_and_takes_no_decay():
    placed = placement(kind_model("softmax-mha", tied=True))
    assert "head.weight" not in {**placed.muon, **placed.adamw} and "embed.weight" in placed.adamw_no_decay


def test_an_undeclared_matrix_is_one_line_naming_it_and_its_layer():
    model = kind_model("softmax-mha")
    model.blocks[1].attn.mixer = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ConfigError, match=r"^optim=muon: blocks\.1\.attn\.mixer \(4, 4\) is a 2-D parameter but not "
                                          r"an nn\.Linear weight; SoftmaxAttention must name it in adamw_parameters"):
        placement(model)


# ---------------------------------------------------------------------------- one optimizer, exact resume


def batches(count: int):
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 61, (2, 9), generator=generator) for _ in range(count)]


def train_steps(model, optimizer, schedule, data) -> None:
    for batch in data:
        def closure(batch=batch):
            optimizer.zero_grad()
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            return loss
        optimizer.step(closure)
        schedule.step()


def optimizer_and_schedule(model, o):
    optimizer = build_optimizer(model, o)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(o, total_steps=8))


def test_muon_and_adamw_step_as_one_optimizer_and_its_state_dict_resumes_exactly():
    o = MuonConfig(warmup_steps=2, fused=False)
    data = batches(6)
    model = kind_model("gated_delta")
    optimizer, schedule = optimizer_and_schedule(model, o)
    assert isinstance(optimizer, MuonAdamW) and isinstance(optimizer.muon, SplitMuon)
    assert [g["lr"] for g in optimizer.param_groups] == [o.lr / 2, o.adamw_lr / 2, o.adamw_lr / 2]  # warm-up step 0
    train_steps(model, optimizer, schedule, data[:3])
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": copy.deepcopy(optimizer.state_dict()), "schedule": schedule.state_dict()}
    train_steps(model, optimizer, schedule, data[3:])

    resumed = kind_model("gated_delta")
    resumed.load_state_dict(saved["model"])
    optimizer2, schedule2 = optimizer_and_schedule(resumed, o)
    optimizer2.load_state_dict(saved["optimizer"])
    schedule2.load_state_dict(saved["schedule"])
    assert optimizer2.muon.state is optimizer2.state and optimizer2.adamw.param_groups[0] is optimizer2.param_groups[1]
    train_steps(resumed, optimizer2, schedule2, data[3:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_the_closure_runs_once_a_step_and_its_loss_comes_back():
    model = kind_model("softmax-gqa")
    optimizer = build_optimizer(model, MuonConfig(fused=False))
    calls = []

    def closure():
        calls.append(1)
        loss = model(batches(1)[0]).float().pow(2).mean()
        loss.backward()
        return loss

    before = model.blocks[0].attn.qkv.weight.detach().clone()
    assert torch.isfinite(optimizer.step(closure)) and len(calls) == 1
    assert not torch.equal(before, model.blocks[0].attn.qkv.weight)


def test_a_resumed_run_applies_its_own_settings_to_each_group():
    model = kind_model("softmax-mha")
    # cosine: at step 3 of 8 its multiplier is below 1, so a rate left unscaled would show (wsd's is 1 there)
    optimizer, schedule = optimizer_and_schedule(model, MuonConfig(warmup_steps=2, schedule="cosine"))
    train_steps(model, optimizer, schedule, batches(3))
    changed = MuonConfig(warmup_steps=2, schedule="cosine", lr=0.01, adamw_lr=1e-3, weight_decay=0.0, momentum=0.9)
    apply_settings(optimizer, schedule, changed)
    multiplier = lr_multiplier(3, "cosine", 2, 8, 0.1, 0.2)
    assert multiplier < 0.99
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01 * multiplier, 1e-3 * multiplier,
                                                                        1e-3 * multiplier])
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["weight_decay"] == 0.0
    assert schedule.base_lrs == [0.01, 1e-3, 1e-3] and optimizer.muon.param_groups[0]["momentum"] == 0.9


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("step, expected", [
    (0, 0.1), (9, 1.0),                                   # warm-up: (step + 1) / 10
    (10, 1.0), (60, 0.1 + 0.9 * 0.5), (110, 0.1), (200, 0.1),  # cosine over steps 10..110
    (35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))),
])
def test_cosine(step, expected):
    assert lr_multiplier(step, "cosine", 10, 110, 0.1, 0.2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("step, expected", [
    (0, 0.1), (9, 1.0), (10, 1.0), (60, 1 - 0.9 * 0.5), (85, 1 - 0.9 * 0.75), (110, 0.1), (150, 0.1),
])
def test_linear(step, expected):
    assert lr_multiplier(step, "linear", 10, 110, 0.1, 0.2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("step, expected", [
    (0, 0.1), (9, 1.0),                  # warm-up
    (10, 1.0), (50, 1.0), (79, 1.0),     # stable until the last 20% of 100 steps
    (80, 1.0), (90, 1 - 0.9 * 0.5), (95, 1 - 0.9 * 0.75), (100, 0.1), (130, 0.1),  # linear decay over 80..100
])
def test_wsd(step, expected):
    assert lr_multiplier(step, "wsd", 10, 100, 0.1, 0.2) == pytest.approx(expected, abs=1e-12)


def test_wsd_never_decays_before_warm_up_ends():
    values = [lr_multiplier(s, "wsd", 10, 20, 0.0, 0.9) for s in range(21)]
    assert values[:10] == [(s + 1) / 10 for s in range(10)]
    assert values[10:] == pytest.approx([1 - s / 10 for s in range(11)])  # decays over 10..20, not 2..20


def test_a_longer_run_keeps_wsd_stable_where_cosine_jumps():
    """What a changed trainer.max_steps does to a resumed run at step 300 of first 500, then 1000 steps."""
    for schedule, same in (("wsd", True), ("cosine", False), ("constant", True)):
        before, after = (lr_multiplier(300, schedule, 50, total, 0.1, 0.2) for total in (500, 1000))
        assert (before == after) is same


def test_constant_warms_up_then_holds_the_peak_past_any_total():
    values = [lr_multiplier(s, "constant", 10, 20, 0.1, 0.2) for s in range(200)]
    assert values[:10] == [(s + 1) / 10 for s in range(10)]
    assert values[10:] == [1.0] * 190  # past total_steps too: a continued run stays at the peak


# ---------------------------------------------------------------------------- settings


def test_the_muon_yaml_composes_the_dataclass_and_states_no_value():
    stated = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "optim" / "muon.yaml"))
    assert stated == {"defaults": [{"/optim/settings@_here_": "muon"}]}
    assert optim_settings(compose_config("train", ["optim=muon"]).optim) == MuonConfig()


def test_a_run_config_written_before_a_key_existed_takes_its_default():
    assert optim_settings({"lr": 1e-3, "warmup_steps": 5}) == OptimConfig(lr=1e-3, warmup_steps=5)


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=step"], "optim.schedule='step' is not one of ['constant', 'cosine', 'linear', 'wsd']"),
    (["optim.decay_fraction=0"], "optim.decay_fraction=0 must be in (0, 1]"),
    (["optim.decay_fraction=1.5"], "optim.decay_fraction=1.5 must be in (0, 1]"),
    (["optim.fused=maybe"], "optim.fused='maybe' must be true or false"),
    (["optim.name=sgd"], "optim.name='sgd' is not one of ['adamw', 'muon']"),
    (["optim=adamw", "optim.name=muon"],
     "optim.name=muon takes its settings from its group: choose it with optim=muon"),
    (["optim=muon", "optim.momentum=1"], "optim.momentum=1 must be in [0, 1)"),
    (["optim=muon", "optim.ns_steps=0"], "optim.ns_steps=0 must be an integer from 1 to 99"),
    (["optim=muon", "optim.adjust_lr=rms"], "optim.adjust_lr='rms' is not one of ['match_rms_adamw', 'original']"),
    (["optim=muon", "optim.adamw_lr=-1"], "optim.adamw_lr=-1 must be a positive number"),
    (["optim=muon", "optim.adamw_weight_decay=nan"], "optim.adamw_weight_decay=nan must be a finite number >= 0"),
    (["optim=muon", "optim.nesterov=1"], "optim.nesterov=1 must be true or false"),
    (["optim=muon", "optim.lr=inf"], "optim.lr=inf must be a positive number"),
    (["optim=muon", "optim.name=adamw"], "optim.momentum is not a setting of optim=adamw; it takes name, lr, "
                                         "min_lr_ratio, warmup_steps, schedule, decay_fraction, weight_decay, beta1, "
                                         "beta2, fused"),
    (["optim=muon", "trainer=fsdp"], "optim=muon cannot train under trainer.strategy=fsdp: Newton-Schulz needs each "
                                     "whole matrix and FSDP shards them across devices; use trainer=ddp"),
    (["optim=muon", "optim.schedule=wsd", "optim.decay_fraction=1"], None),
    (["optim=muon", "trainer=ddp"], None),
])
def test_each_bad_optim_setting_is_one_line_naming_the_key(overrides, message):
    cfg = compose_config("train", overrides)
    if message is None:
        check_run_settings(TrainRun.from_config(cfg))
        return
    with pytest.raises(ConfigError) as error:
        check_run_settings(TrainRun.from_config(cfg))
    assert str(error.value) == message
