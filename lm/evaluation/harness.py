"""An lm-evaluation-harness model for any lm checkpoint, of any attention kind, as `--model lm`.

    python scripts/harness.py --model lm --model_args ckpt=checkpoints/<run>/last.ckpt --tasks ...

The harness's own TemplateLM splits each (context, continuation) the way its `hf` model does
(encode both together, cut at the context's length, trailing spaces moved to the continuation),
so an exported Llama folder scored through `hf` and the checkpoint scored here see the same
tokens. Scoring runs batches of right-padded sequences through the plain forward (padding after
a sequence cannot change its causal logits); rolling log-likelihoods use the harness's own
windows; generation goes through lm's cached decoding with the task's stop strings.

The model's arguments are checked before the checkpoint loads, and `run_cli` turns what the harness
refuses before scoring (an unknown task, its arguments, a task whose data cannot be loaded) into
one line and exit code 2, as lm's own scripts do.

Shapes: B batch, T tokens, V vocab size.
"""

from __future__ import annotations

import logging
import re
import traceback

import lm_eval.models  # noqa: F401  (the harness's own models first: it skips them once its registry is non-empty)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.api.task import Task
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm.auto import tqdm

from lm.data.tokenizer import EOT
from lm.formats.checkpoint import load
from lm.generation.decode import Generation, Sampling
from lm.util.checks import check_device, require_int
from lm.util.errors import ConfigError, DataError, one_line
from lm.util.paths import resolve_path

log = logging.getLogger("lm_eval.models.lm")  # a child of `lm_eval`, the one logger the harness command prints

MODEL_ARGS = ("ckpt", "device", "batch_size", "max_gen_toks")
HARNESS_FLAGS = ("device", "batch_size")  # what the harness passes from its own --device and --batch_size
HARNESS_DEVICE = "cuda:0"  # the harness's --device when none is typed
AUTO_BATCH = 8  # "auto": this model has no search for the largest batch that fits, so a fixed one


def whole_number(name: str, value) -> int:
    """A count typed on the command line: --batch_size reaches the model as text, --model_args as int."""
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    require_int(name, value)
    return value


def batch_size_of(value) -> int:
    # "auto" and "auto:N" are the harness's own values, asking it to search for the batch that fits;
    # this model has no such search and runs them at the fixed AUTO_BATCH (logged when it loads).
    if isinstance(value, str) and re.fullmatch(r"auto(:\d+)?", value.strip()):
        return AUTO_BATCH
    return whole_number("batch_size", value)


def checked_arguments(ckpt=None, device="cpu", batch_size=8, max_gen_toks=256, **_harness) -> tuple[str, int, int]:
    """(ckpt, batch size, max_gen_toks) once every argument is known to work, before anything loads."""
    batch = batch_size_of(batch_size)
    max_gen_toks = whole_number("max_gen_toks", max_gen_toks)
    check_device(device)
    if ckpt is None or not str(ckpt).strip():
        raise ConfigError("--model_args has no ckpt: --model lm needs ckpt=<a checkpoint, run folder or exported "
                          "folder>, e.g. --model_args ckpt=checkpoints/<run>/last.ckpt")
    return str(ckpt), batch, max_gen_toks


@register_model("lm")
class HarnessModel(TemplateLM):
    def __init__(self, ckpt: str | None = None, device: str = "cpu", batch_size: int | str = 8,
                 max_gen_toks: int = 256, max_batch_size: int | None = None, trust_remote_code: bool | None = None):
        super().__init__()
        # max_batch_size bounds the harness's own "auto" search, which this model does not run, and
        # trust_remote_code concerns transformers' code: both are accepted because the harness passes them.
        ckpt, self.batch_size, self.max_gen_toks = checked_arguments(ckpt, device, batch_size, max_gen_toks)
        if str(batch_size).strip().startswith("auto"):
            log.info("batch_size=%s: --model lm scores %d sequences at a time", batch_size, AUTO_BATCH)
        self.model, self.tokenizer = load(resolve_path(ckpt), device=device)
        self._device = torch.device(device)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> HarnessModel:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> HarnessModel:
        """The model from --model_args and the harness's --device and --batch_size. The harness always
        passes those two, cuda:0 and 1 when not typed, so the same name in --model_args (which the user
        did type) wins rather than failing as a keyword given twice."""
        unknown = [key for key in arg_dict if key not in (*MODEL_ARGS, "trust_remote_code")]
        if unknown:
            raise ConfigError(f"--model_args {unknown[0]}={arg_dict[unknown[0]]!r} is not an argument of --model lm "
                              f"(it takes {', '.join(MODEL_ARGS)})")
        checked_arguments(**arg_dict)  # what --model_args says first: the harness's defaults were not typed
        flags = {k: v for k, v in (additional_config or {}).items() if v is not None and k in HARNESS_FLAGS}
        for key in HARNESS_FLAGS:
            if key in flags and key not in arg_dict:
                check_flag(key, flags[key])
        return cls(**{**flags, **arg_dict})

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.token_to_id(EOT)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string).ids

    def _context_limit(self) -> int | None:
        return self.model.config.max_seq_len + 1 if self.model.context_limited else None

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        limit = self._context_limit()
        for first in tqdm(range(0, len(requests), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            chunk = requests[first:first + self.batch_size]
            # The continuation whole, the context cut from the left when the model's window is full.
            sequences = [(ctx + cont)[-limit:] if limit else ctx + cont for _, ctx, cont in chunk]
            width = max(map(len, sequences))
            batch = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=self.device)  # (B, width)
            logprobs = F.log_softmax(self.model(batch[:, :-1]).float(), dim=-1)  # (B, width - 1, V)
            for row, (sequence, (_, _, cont)) in enumerate(zip(sequences, chunk, strict=True)):
                n = len(cont)
                positions = torch.arange(len(sequence) - 1 - n, len(sequence) - 1, device=self.device)
                picked = logprobs[row, positions]  # (n, V): the predictions of the continuation's tokens
                target = torch.tensor(cont, device=self.device)
                results.append((float(picked.gather(1, target[:, None]).sum()),
                                bool((picked.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document on its own, after <|endoftext|>, cut into the harness's own rolling windows of
        max_seq_len predictions (the last one with as much earlier context as fits), as its `hf` model does."""
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.model.config.max_seq_len, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(logprob for logprob, _ in scores))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            if self.model.context_limited:  # leave room for at least one token of context
                max_new = min(max_new, self.model.config.max_seq_len - 1)
            sampling = Sampling(temperature=float(gen_kwargs.get("temperature", 0.0)))
            ids = self.tok_encode(context) or [self.eot_token_id]
            run = Generation(self.model, [ids], max_new, sampling, stop=until, tokenizer=self.tokenizer,
                             eos_id=self.eot_token_id, truncate="left" if self.model.context_limited else None)
            for _ in run:
                pass
            text = self.tokenizer.decode(run.tokens[0][len(run.prompts[0]):])
            cuts = [text.find(s) for s in until if s in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out


def check_flag(key: str, value) -> None:
    """--device or --batch_size as the harness passed it, named as a flag: the user may not have typed it."""
    try:
        if key == "device":
            check_device(value)
        else:
            batch_size_of(value)
    except ConfigError as e:
        default = " (the harness's default)" if key == "device" and value == HARNESS_DEVICE else ""
        raise ConfigError(f"--{key} {value}{default}: {e}") from None


# ------------------------------------------------------------------ the harness's command line

def run_cli() -> None:
    """The harness's command line, its refusals of the user's input made one line and exit code 2."""
    from lm_eval.__main__ import cli_evaluate

    from lm.util.cli import exit_on_user_error

    with exit_on_user_error():
        try:
            cli_evaluate()
        except Exception as e:
            refusal = harness_refusal(e)
            if refusal is None:
                raise
            raise refusal from None


def harness_refusal(error: Exception) -> ConfigError | DataError | None:
    """The user error behind an exception the harness raised before scoring anything, or None.

    The harness raises plain ValueError, KeyError, ConnectionError ... both for what the user typed
    and for its own faults, so the place it was raised decides: reading its arguments and tasks
    (EvaluatorConfig) or loading a task and its data (TaskManager), both before the model scores."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    modules = [frame.f_globals.get("__name__", "") for frame in frames]
    if "lm_eval.tasks.manager" in modules:
        task = task_being_loaded(frames)
        named = f"task {task!r}" if task else "a task of --tasks"
        if isinstance(error, ConnectionError) or any(m.split(".")[0] in ("datasets", "huggingface_hub", "fsspec")
                                                     for m in modules):
            offline = "; offline, only datasets already in the datasets cache load" \
                if isinstance(error, ConnectionError) else ""
            return DataError(f"the data of {named} could not be loaded ({one_line(error, 300)}){offline}")
        return ConfigError(f"{named} could not be loaded: {one_line(error, 300)}")
    if "lm_eval.config.evaluate_config" in modules:
        if any(frame.f_code.co_name == "process_tasks" for frame in frames):
            return ConfigError(f"--tasks: {one_line(error, 300)} (`python scripts/harness.py ls tasks` lists them; "
                               "--include_path adds a folder of task YAMLs)")
        return ConfigError(one_line(error, 300))
    return None


def task_being_loaded(frames) -> str | None:
    """The innermost task under construction, else the innermost name the TaskManager was asked for."""
    for frame in reversed(frames):
        task = frame.f_locals.get("self")
        if isinstance(task, Task) and getattr(getattr(task, "config", None), "task", None):
            return task.config.task
    for frame in reversed(frames):
        spec = frame.f_locals.get("spec")
        if frame.f_code.co_name == "_load_spec" and isinstance(spec, (str, dict)):
            return spec if isinstance(spec, str) else spec.get("task")
    return None
