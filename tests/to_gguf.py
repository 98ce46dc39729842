"""Convert a pdscope-made checkpoint to GGUF with llama.cpp's own converter.

    python tests/to_gguf.py LLAMA_CPP_TREE MODEL_DIR OUT.gguf

pdscope's models carry a byte-level BPE tokenizer.json that splits text with GPT-2's pattern.
The converter names a tokenizer's pre-tokenizer by hashing what it makes of a test string and
refuses hashes it does not list, so it is told "gpt-2" here; and it tries sentencepiece first,
which such a tokenizer has no model for (Gemma 2's converter tries nothing else, so it is sent
to the BPE path). Checkpoints of architectures make-model does not make (written with
transformers) carry the same tokenizer, with `"tokenizer_class": "GPT2Tokenizer"` for Phi-3's
converter. Everything else (tensor names, the Q/K rows reordered for llama.cpp's rope, the
metadata) is the converter's own.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    tree, model, out = (Path(a) for a in sys.argv[1:4])
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    from conversion import base, gemma  # llama.cpp's converter package

    def no_sentencepiece(self: object) -> None:
        raise FileNotFoundError("a byte-level BPE tokenizer.json, no sentencepiece model")

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    gemma.Gemma2Model.set_vocab = base.TextModel._set_vocab_gpt2
    script = tree / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(model), "--outfile", str(out), "--outtype", "bf16"]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
