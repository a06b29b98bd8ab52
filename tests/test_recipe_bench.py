"""bench.py recipe: two recipes trained in turns, each scored on held-out text in bits per byte, and the
time each took to the targets, read from its --json results. Its refusals are rows of
tests/test_command_fuzz.py's BENCH table."""

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_recipe_is_scored_on_the_documents_chosen_with_the_first_recipes_tokenizer(monkeypatch):
    """The first contender chooses the held-out documents by its own token count; every other one is
    handed those documents, whatever its vocabulary (per-tokenizer choices would score other text)."""
    from benchmarks import recipe_bench

    given = []

    def build(self, held_out):
        given.append(held_out)
        self.documents = [f"chosen with {self.name}'s tokenizer"] if isinstance(held_out, int) else held_out
        self.held_out = (None, None, len(self.documents[0]), len(self.documents))
        self.precision = "32-true"
        return self

    def evaluate(self):
        self.curve.append({"steps": 0, "tokens": 0, "seconds": 0.0, "bits_per_byte": 1.0})
        return 1.0

    monkeypatch.setattr(recipe_bench.Contender, "configure", lambda self: self)  # max_steps 0: no training
    monkeypatch.setattr(recipe_bench.Contender, "build", build)
    monkeypatch.setattr(recipe_bench.Contender, "evaluate", evaluate)
    args = argparse.Namespace(recipe=["a=", "b=data.vocab_size=4096", "c=data.vocab_size=512"], a=None, b=None,
                              eval_every=1, held_out_tokens=5000, targets=[1.0], out=None)
    results = recipe_bench.bench_recipe(args)
    assert given == [5000, ["chosen with a's tokenizer"], ["chosen with a's tokenizer"]]
    assert {c["held_out_bytes"] for c in results["contenders"].values()} == {len("chosen with a's tokenizer")}


@pytest.mark.slow
def test_two_recipes_in_turns_give_their_curves_and_time_to_each_target(tmp_path, small_corpus):
    tiny = (f"data=text data.paths=[{small_corpus}/*.py] data.vocab_size=300 data.cache_dir={tmp_path}/cache "
            "model.n_layer=1 model.d_model=32 model.n_head=2 model.d_ff=64 model.max_seq_len=32 data.batch_size=4 "
            "trainer.max_steps=12 optim=adamw")
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "recipe", "--a", tiny, "--b",
                             f"{tiny} optim=muon optim.lr=0.02 data.vocab_size=400", "--eval-every", "128",
                             "--held-out-tokens", "30000", "--targets", "99", "0.001", "--out", str(tmp_path),
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert results["contenders"]["a"]["held_out_bytes"] == results["contenders"]["b"]["held_out_bytes"] > 0
    for name in ("a", "b"):
        run = results["contenders"][name]
        assert run["steps"] == 12 and run["tokens"] == 12 * 4 * 32
        # step 0, then every 128 tokens (one step of 4 x 32): 13 evaluations, seconds never going back
        assert [p["steps"] for p in run["curve"]] == list(range(13))
        assert all(a["seconds"] <= b["seconds"] for a, b in itertools.pairwise(run["curve"]))
        assert run["curve"][-1]["bits_per_byte"] < run["curve"][0]["bits_per_byte"]
    reached, unreachable = results["targets"]
    assert reached["a"] == reached["b"] == {"tokens": 0, "seconds": 0.0}  # 99 bits per byte: before training
    assert reached["seconds_ratio"] == {"b": None}  # no ratio of two zeros
    assert unreachable["a"] is None and unreachable["b"] is None and unreachable["seconds_ratio"] == {"b": None}
    assert "not reached" in result.stdout and (tmp_path / "recipe.png").stat().st_size > 0
