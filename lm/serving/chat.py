"""Chat templates: how a list of messages becomes the text a model continues.

A model trained by `lm` on plain text has no chat format, so it has no template; a Hugging Face
folder carries one in tokenizer_config.json (`chat_template`, a Jinja template, as transformers'
`apply_chat_template` renders it), and `chat_template=<file>` gives one to any model. Templates run
in Jinja's sandbox: a template is data from a checkpoint, not code to trust.
"""

from __future__ import annotations

import json
from pathlib import Path

from lm.util.errors import ConfigError


def read_chat_template(setting: str | None, checkpoint: Path) -> str | None:
    """The template `setting` names (a file), else the checkpoint folder's own, else None."""
    if setting is not None:
        path = Path(setting)
        if not path.is_file():
            raise ConfigError(f"chat_template={setting!r} is not a file")
        return path.read_text(encoding="utf-8")
    config = checkpoint / "tokenizer_config.json" if checkpoint.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError):
        raise ConfigError(f"{str(config)!r} is not a JSON object") from None
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


class ChatTemplate:
    """A compiled template; `render(messages)` the prompt text, ending where the assistant speaks."""

    def __init__(self, source: str, eos_token: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self.template = environment.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"the chat template does not compile: {e}") from None
        self.eos_token = eos_token

    def render(self, messages: list[dict]) -> str:
        """Raises ValueError with the template's own words when it refuses the messages."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, eos_token=self.eos_token,
                                        bos_token="")
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


__all__ = ["ChatTemplate", "read_chat_template"]
