"""A model's tokenizer, loaded once per process.

`run` needs it twice, for job creation's prompt-length check and for the model it decodes
with: parsing a 3.5 MB tokenizer.json took 0.3-0.7 s each time on the 2-core VMs. No
torch here: the producer loads tokenizers without the engine.

A Llama directory whose tokenizer_config.json names `TokenizersBackend` (what
transformers 5 saves, our GGUF copies included) loads with that class directly: it is the
class `AutoTokenizer` picks there, and AutoTokenizer first reads the model's config
through transformers' `configuration_llama`, whose imports (torch.distributed, sympy) took
~0.7 s of every start here; where eagle2_core.lean_tokenizer knows its settings, without
importing transformers at all. Anything else goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from eagle2_core.lean_tokenizer import lean_tokenizer

BACKEND = "TokenizersBackend"


def _names_backend(source: Path | str) -> bool:
    """A local Llama directory whose tokenizer config names the backend class, no code."""
    directory = Path(source)
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        model = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        settings.get("tokenizer_class") == BACKEND
        and "auto_map" not in settings
        and model.get("model_type") == "llama"
        and "auto_map" not in model
    )


def load_tokenizer(
    source: Path | str, *, allow_download: bool = False, trust_remote_code: bool = False
) -> Any:
    """transformers' tokenizer of a model directory or Hub id (OSError where it cannot);
    callers share the object and must not change it. One load per source and options
    however they are spelled: lru_cache keys `f(x)` and `f(x, flag=False)` apart, and job
    creation and the model load each parsed it (0.1-0.2 s of every `run`)."""
    return _load(source, allow_download, trust_remote_code)


@lru_cache(maxsize=8)
def _load(source: Path | str, allow_download: bool, trust_remote_code: bool) -> Any:
    if _names_backend(source):
        lean = lean_tokenizer(Path(source))
        if lean is not None:
            return lean
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        source, local_files_only=not allow_download, trust_remote_code=trust_remote_code
    )
