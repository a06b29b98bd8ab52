"""The shared tables of attention kinds, built from the registry: every registered kind with each
setting it declares (`examples`, in its own file), plus a few hybrids that exercise the ways of
writing a model's per-layer list. A new kind joins every table by existing."""

from lm.attention import LinearSpec, SlidingSpec, SoftmaxSpec, example_rows, layer_specs
from lm.attention.additive import AdditiveSpec
from lm.attention.efficient import EfficientSpec
from lm.attention.gated_delta import GatedDeltaSpec
from lm.attention.lowrank import LowRankSpec

N_HEAD = 4  # the shared tests' models have 4 query heads

HYBRIDS = {  # name -> (the model's attention for 2 layers, n_kv_head)
    "hybrid-linear-sliding": ([LinearSpec(chunk_size=4), SlidingSpec(window=3)], 2),
    "hybrid-efficient-softmax": ([EfficientSpec(chunk_size=4), SoftmaxSpec()], 2),
    "hybrid-additive-linear": ([AdditiveSpec(block=4), LinearSpec(chunk_size=4)], 4),
    "hybrid-lowrank-sliding": ([LowRankSpec(block=3, rank=1), SlidingSpec(window=4)], 2),
    "hybrid-gated-delta-softmax": ([GatedDeltaSpec(chunk_size=4, conv_size=3), SoftmaxSpec()], 2),
    "sliding-per-layer": ([SlidingSpec(window=3), SlidingSpec(window=6, dilation=3)], 4),
    "sliding-global": (layer_specs("sliding", 2, {"window": 5}, global_every=2), 2),
}


def model_rows() -> dict:
    """name -> (attention, n_kv_head) of a 2-layer, 4-head model."""
    rows = {name: (spec, example.n_kv_head or N_HEAD) for name, (spec, example) in example_rows().items()}
    return {**rows, **HYBRIDS}
