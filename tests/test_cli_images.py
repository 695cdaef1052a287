"""`nexttoken generate --image PATH` (repeatable), run as a user runs it, on a tiny Gemma3ForConditionalGeneration:
the tokens of transformers' processor + generate with the same images."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import transformers
from PIL import Image

from support.vision import gemma3_vlm


def test_generate_with_images(tmp_path) -> None:
    hf, processor = gemma3_vlm(tmp_path / "model", seed=4)
    paths = []
    for i, shape in enumerate(((40, 30, 3), (12, 70))):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8)).save(paths[-1])
    text = "<start_of_image> versus <start_of_image>:"
    r = subprocess.run([sys.executable, "-m", "nexttoken.cli", "generate", text, "--model", str(tmp_path / "model"),
                        "--image", str(paths[0]), "--image", str(paths[1]), "--json", "--max-new-tokens", "6"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    inputs = processor(text=text, images=[transformers.image_utils.load_image(str(p)) for p in paths],
                       return_tensors="pt")
    expected = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert json.loads(r.stdout)["token_ids"] == expected
