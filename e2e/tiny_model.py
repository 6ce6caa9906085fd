"""Write a tiny random-weight Llama and a word-level tokenizer to a folder (no hub access).

Run with the vLLM environment's Python (it needs torch, transformers and tokenizers):
``python tiny_model.py OUT_DIR``. Deterministic (seeded), so the folder can be cached and
vLLM's compile cache stays warm across runs. The shape is the smallest the CPU kernels take:
head_dim 64 (hidden 128, 2 heads); head_dim 16 is rejected by the CPU attention backend.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = 500
HIDDEN = 128
HEADS = 2
LAYERS = 2
MAX_POSITIONS = 4096
SPECIAL = ("<unk>", "<s>", "</s>")


def write_tokenizer(out: Path) -> int:
    """A whitespace word-level tokenizer over ``w0 .. w{WORDS-1}``; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found]

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": len(SPECIAL) + i for i in range(WORDS)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(out)
    return len(vocab)


def write_model(out: Path, vocab_size: int) -> None:
    import torch  # type: ignore[import-not-found]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out)
    write_model(out, vocab_size)
    print(json.dumps({"model": str(out), "vocab_size": vocab_size}))


if __name__ == "__main__":
    main()
