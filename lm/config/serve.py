"""scripts/serve.py's settings: each one's default, meaning and bound, declared once here.

conf/serve.yaml composes them (`serve_settings`), its --help lists them, and the script checks them
before the checkpoint is read. The quantisation kernel's names are the generation layer's
(lm.generation.quantize.KERNELS), checked where the model is quantised.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm.config.settings import store
from lm.generation.compiled import COMPILE_MODES
from lm.util.checks import require_choice, require_int
from lm.util.settings import Bound, Checked, boolean, choice, integer, setting

PORT = Bound("an integer in [0, 65535] (0: any free port)", lambda n, v: require_int(n, v, 0, 65535))
INT8 = Bound("null or int8", lambda n, v: require_choice(n, v, ("int8",)), nullable=True)


@dataclass(kw_only=True)
class ServeSettings(Checked):
    ckpt: str = setting(help="a training checkpoint, its run folder, or an exported or Hugging Face folder")
    host: str = setting("127.0.0.1", "the address to listen on (0.0.0.0: every interface)")
    port: int = setting(8000, "the port to listen on", PORT)
    model_name: str | None = setting(None, "the name clients pass as `model`; null: the checkpoint's run folder")
    max_batch: int = setting(16, "slots decoded together: requests running at once", integer(1))
    max_queue: int = setting(64, "requests waiting for a slot; beyond it a request gets 429", integer(0))
    max_new_tokens: int = setting(512, "the most `max_tokens` a request may ask for", integer(1))
    max_prompt_tokens: int = setting(8192, "the longest prompt accepted, in tokens (full attention: also "
                                           "within the model's max_seq_len)", integer(1))
    chat_template: str | None = setting(None, "a Jinja chat template file for /v1/chat/completions; null: the "
                                              "checkpoint's own (a Hugging Face folder's tokenizer_config.json)")
    api_key: str | None = setting(None, "clients must send `Authorization: Bearer <key>`; null: the LM_API_KEY "
                                        "environment variable, or no key at all")
    compile: bool = setting(False, "true: torch.compile the decoding step over the slots (the first step compiles)",
                            boolean())
    compile_mode: str = setting("default", "with compile=true: default, or max-autotune (the CPU: the step compiled "
                                           "with frozen weights and inductor's autotuned matmuls; faster steps, a "
                                           "first step of up to a minute)", choice(COMPILE_MODES))
    quantize: str | None = setting(None, "int8: int8 matmul weights", INT8)
    int8_kernel: str = setting("auto", "with quantize=int8: auto (chosen by the device's int8 instructions, and "
                                       "said), dynamic, native, dequant or int8pack")
    device: str = setting("cpu", "cpu, cuda[:n] or mps")
    drain_s: int = setting(30, "on SIGTERM or Ctrl-C: seconds the running and waiting requests get to finish; "
                               "each one left then ends with a 503", integer(0))


store("serve_settings", ServeSettings)

__all__ = ["ServeSettings"]
