"""Build a tiny, deterministic Qwen2 model and tokenizer locally, without a model hub.

Tests, the CPU demo and benchmarks need a real model folder that both transformers (the trainer)
and SGLang (the rollout server) load. `make_tiny_model` writes one: a byte-level BPE tokenizer
trained with the `tokenizers` library on a fixed, sorted set of Python standard-library sources,
wrapped as `PreTrainedTokenizerFast` with ChatML special tokens and chat template, plus a seeded
`Qwen2ForCausalLM` (hidden 128, 2 layers by default) saved as safetensors, into a new folder,
built beside it and renamed into place (`cached_build.build_once`), so the folder holds a whole
model or nothing. `ensure_tiny_model` caches the result on disk the same way, so concurrent test
workers share one copy.

torch, transformers and tokenizers are imported inside the functions: importing this module is
cheap and works in the slim sidecar environment.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import sys
import sysconfig
from pathlib import Path
from typing import Any

from .bounded_http import parse_json
from .cached_build import build_once

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when the output of `make_tiny_model` changes for the same arguments (invalidates caches)."""

DEFAULT_CACHE_DIR = Path("~/.cache/rollout-service/tiny-models")

PARAMS_FILE = "tiny_model_params.json"
"""In each model folder: the arguments it was built with (`tiny_model_params`)."""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as used by Qwen2 chat models, without a default system prompt."""

MIN_CORPUS_BYTES = 2_000_000
CORPUS_BYTES_PER_TOKEN = 400
MAX_POSITION_EMBEDDINGS = 2048
INITIALIZER_RANGE = 0.1
"""Wider than Qwen2's 0.02 so that greedy decoding has clear winners: engines that differ in the
last float bits (SGLang vs transformers) then still agree token for token."""


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    tied: bool = False,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 4096,
    dtype: str = "float32",
) -> Path:
    """Write a tiny Qwen2ForCausalLM and its tokenizer into the new folder `out_dir`; return it.

    The same arguments on the same Python version give the same tokenizer and the same weights.
    `tied` shares the input embedding with `lm_head` (the checkpoint then has no
    `lm_head.weight`), which exercises engines' tied-weight reload paths.

    `out_dir` must not exist yet, or be an empty folder (which keeps its mode). The model is built
    in a hidden sibling folder and renamed into place, so `out_dir` holds a whole model or
    nothing, even when the build fails or is killed. A folder that already holds the model of
    these very arguments (its `tiny_model_params.json` says so) is returned as it is, so a rerun
    on the same volume succeeds; anything else there is refused with a `FileExistsError` and never
    touched. A folder made here is readable by all (0755, files 0644: a shared model volume).
    """
    _torch_dtype(hidden_size, dtype)  # bad arguments fail before anything is touched
    params = tiny_model_params(
        tied=tied, seed=seed, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, dtype=dtype
    )
    out = Path(out_dir)
    if _holds_model(out, params):
        logger.info("%s already holds this tiny model; left as it is", out)
        return out
    kept_mode = _take_empty_folder(out)

    def build(staging: Path) -> None:
        _write_tiny_model(
            staging,
            tied=tied,
            seed=seed,
            hidden_size=hidden_size,
            num_layers=num_layers,
            vocab_size=vocab_size,
            dtype=dtype,
        )
        if kept_mode is not None:
            staging.chmod(kept_mode)

    try:
        build_once(out, build)
    except BaseException:
        if kept_mode is not None:
            _restore_empty_folder(out, kept_mode)
        raise
    if not _holds_model(out, params):  # another process filled `out` first: its folder is kept
        raise FileExistsError(
            f"{out} was filled by another process while this one built the tiny model, with something other"
            " than this model: left as it is; run again with an --out that does not exist yet"
        )
    logger.info("tiny Qwen2 model (%s, %s) ready in %s", "tied" if tied else "untied", dtype, out)
    return out


def _write_tiny_model(
    folder: Path,
    *,
    tied: bool = False,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 4096,
    dtype: str = "float32",
) -> None:
    """Write the model, its tokenizer and `tiny_model_params.json` into the (staging) `folder`,
    which this process made and which nothing else sees yet."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch_dtype = _torch_dtype(hidden_size, dtype)
    tokenizer = build_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=tied,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[ENDOFTEXT],
        pad_token_id=ids[ENDOFTEXT],
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[ENDOFTEXT],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=False,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = tiny_model_params(
        tied=tied, seed=seed, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, dtype=dtype
    )
    (folder / PARAMS_FILE).write_text(json.dumps(params, indent=2, sort_keys=True))
    _make_world_readable(folder)


def _torch_dtype(hidden_size: int, dtype: str) -> Any:
    """The torch dtype named `dtype`; a ValueError for it or a `hidden_size` the model cannot have."""
    import torch

    if hidden_size % 32 != 0:
        raise ValueError(f"hidden_size must be a multiple of 32 (4 heads of even size), got {hidden_size}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'float32' or 'bfloat16', got {dtype!r}")
    return torch_dtype


def _holds_model(folder: Path, params: dict[str, Any]) -> bool:
    """Whether `folder` is a tiny model folder built with `params` (its params file says so)."""
    record = folder / PARAMS_FILE
    try:
        if not folder.is_dir() or not record.is_file() or record.stat().st_size > 64 << 10:
            return False
        return bool(parse_json(record.read_bytes()) == params)
    except (OSError, ValueError):
        return False


def _take_empty_folder(out: Path) -> int | None:
    """Make way for the model at `out`: nothing to do when it does not exist (None); an empty
    folder is removed for the built one to be renamed into its place, and its mode returned
    (the built folder takes it). Anything else there is refused and left alone."""
    try:
        st = out.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(
            f"{out} already exists and is not a folder: give an --out that does not exist yet (or an empty folder)"
        )
    try:
        os.rmdir(out)  # only ever removes an empty folder
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(
                f"{out} already exists and is not empty: make-tiny-model writes a new folder and never changes"
                " what one holds; give an --out that does not exist yet (or an empty folder), or move"
                f" {out} away first"
            ) from None
        raise OSError(
            f"cannot use the empty folder {out} ({exc.strerror}): the model is built in a hidden folder beside it"
            f" and renamed into its place, which needs {out.parent} writable and {out} no mount point; give an"
            f" --out inside it instead, e.g. {out / 'tiny'}"
        ) from None
    return stat.S_IMODE(st.st_mode)


def _restore_empty_folder(out: Path, mode: int) -> None:
    """Put back the empty folder `_take_empty_folder` removed, after a failed build."""
    try:
        out.mkdir()
        out.chmod(mode)
    except OSError as exc:
        logger.warning("could not put the empty folder %s back: %s", out, exc)


def _make_world_readable(folder: Path) -> None:
    """transformers writes weights 0600 and the model is built in a 0700 staging folder (both made
    by this process); a shared model cache must be readable by other users and containers."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


def build_tokenizer(vocab_size: int = 4096) -> Any:
    """Train the byte-level BPE tokenizer on standard-library sources; return a
    `PreTrainedTokenizerFast` with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = training_corpus(max(MIN_CORPUS_BYTES, vocab_size * CORPUS_BYTES_PER_TOKEN))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if bpe.get_vocab_size() < vocab_size:
        logger.warning(
            "BPE training reached only %d of %d tokens; the model keeps %d rows",
            bpe.get_vocab_size(),
            vocab_size,
            vocab_size,
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def training_corpus(min_bytes: int) -> list[str]:
    """The tokenizer's training text: standard-library `.py` files in sorted path order, up to
    at least `min_bytes` bytes (all files if there are fewer)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (
            p
            for p in stdlib.rglob("*.py")
            if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(stdlib).parts)
        ),
        key=lambda p: p.relative_to(stdlib).as_posix(),
    )
    if not files:
        raise RuntimeError(
            f"found no .py files under the standard library at {stdlib}; the tiny tokenizer is "
            "trained on them: use a Python installation that ships its sources"
        )
    texts: list[str] = []
    total = 0
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= min_bytes:
            break
    return texts


def tiny_model_params(
    *,
    tied: bool = False,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 4096,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Everything that determines a tiny model's files, as used for its cache key."""
    return {
        "format_version": FORMAT_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "tied": tied,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "dtype": dtype,
    }


def ensure_tiny_model(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    tied: bool = False,
    **kwargs: Any,
) -> Path:
    """Return the cached tiny model folder for these arguments, building it first if needed.

    The folder is `<cache_dir>/qwen2-<tied|untied>-<hash>` (default cache dir
    `~/.cache/rollout-service/tiny-models`). It is built in a temporary sibling and renamed into
    place, so a folder that exists is complete; when two processes build at once, the first rename
    wins and the other discards its copy. `kwargs` are those of `make_tiny_model`.
    """
    params = tiny_model_params(tied=tied, **kwargs)
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR.expanduser()
    final = root / f"qwen2-{'tied' if tied else 'untied'}-{digest}"

    return build_once(final, lambda staging: _write_tiny_model(staging, tied=tied, **kwargs))
