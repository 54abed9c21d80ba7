"""Stand-in data for DeepSpeed-VisualChat's `llava` data set (its run scripts' first), made offline: DIR/coco/train2017
holds seeded random JPEG images, DIR/llava/detail_23k.json and complex_reasoning_77k.json hold LLaVA-format
conversations about them (one question, one answer each), in the layout its utils/data/llava_dataset.py reads.

usage: make_visualchat_data.py DIR [IMAGES]   (IMAGES: default 48; two conversations per image)"""
import json
import os
import random
import sys

from PIL import Image

WORDS = ("the a photo shows dog cat car tree person table red blue green small large left right near far "
         "sitting standing street room window sky").split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def main(out, images):
    rng = random.Random(0)
    image_dir = os.path.join(out, "coco", "train2017")
    os.makedirs(image_dir, exist_ok=True)
    os.makedirs(os.path.join(out, "llava"), exist_ok=True)
    names = []
    for i in range(images):
        name = f"{i:012d}.jpg"
        pixels = bytes(rng.randrange(256) for _ in range(32 * 32 * 3))
        Image.frombytes("RGB", (32, 32), pixels).resize((96, 96)).save(os.path.join(image_dir, name), quality=90)
        names.append(name)
    for k, file in enumerate(("detail_23k.json", "complex_reasoning_77k.json")):
        rows = [{"id": f"{k}-{i}", "image": name,
                 "conversations": [{"from": "human", "value": "<image>\n" + sentence(rng, 6)[:-1] + "?"},
                                   {"from": "gpt", "value": sentence(rng, 12)}]}
                for i, name in enumerate(names)]
        with open(os.path.join(out, "llava", file), "w") as f:
            json.dump(rows, f)
    print(f"   VisualChat's llava stand-in: {images} images, {2 * images} conversations in {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 48)
