"""A model folder that `vllm serve --load-format dummy` can start from with no download: the Llama-3.1-8B
architecture (bullet_ray's own preset, so both systems run the same shapes) and a synthetic word-level
tokenizer over the whole vocabulary (id i is the word "t<i>"), so every generated token streams as text and
the project's client counts and times each one, as it does with bullet_ray's dummy models (' <id>').

    python3 -m benchmarks.gpu.vllm_model /tmp/llama8b     # needs transformers + tokenizers (on the GPU image)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PRESET = Path(__file__).resolve().parents[2] / "bullet_ray" / "models" / "presets" / "llama-3.1-8b.json"


def write_model_folder(path: str | Path, preset: Path = PRESET) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(preset.read_text())
    config.setdefault("torch_dtype", "bfloat16")
    vocab_size = int(config["vocab_size"])
    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # decoding joins the words with spaces
    bos, eos = config.get("bos_token_id", 1), config.get("eos_token_id", 2)
    eos = eos[0] if isinstance(eos, list) else eos
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token=f"t{bos}",
                            eos_token=f"t{eos}").save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


if __name__ == "__main__":
    print(write_model_folder(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama8b"))
