"""A model's tokenizer, loaded once per process.

`run` needs it twice, for job creation's prompt-length check and for the model it decodes
with: parsing a 3.5 MB tokenizer.json took 0.3-0.7 s each time on the 2-core VMs. No
torch here: the producer loads tokenizers without the engine.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=8)
def load_tokenizer(
    source: Path | str, *, allow_download: bool = False, trust_remote_code: bool = False
) -> Any:
    """transformers' tokenizer of a model directory or Hub id (OSError where it cannot);
    callers share the object and must not change it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        source, local_files_only=not allow_download, trust_remote_code=trust_remote_code
    )
