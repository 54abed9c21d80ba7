"""Stand-ins for what BingBertSquad's nvidia_run_squad_deepspeed.py reads, made offline:

  S3_DIR/bert-large-uncased-vocab.txt  a WordPiece vocabulary (BERT's special tokens and a small word list), served
                                       for its S3 download by bench/ds_examples/site (DSX_S3_BERT=S3_DIR)
  DATA_DIR/train-v1.1.json, dev-v1.1.json  SQuAD v1.1's format: paragraphs of those words, questions whose one answer
                                       is a span of the paragraph (text and character offset)
  DATA_DIR/model.pt                    its --model_file as a DeepSpeed checkpoint ({"module": ...}) with no tensors:
                                       the script loads it with strict=False, so the model keeps its own seeded
                                       initialisation (no pretrained BERT-large here)

usage: make_squad_inputs.py S3_DIR DATA_DIR TRAIN_QUESTIONS DEV_QUESTIONS"""
import json
import os
import random
import sys

import torch

WORDS = ("the a model data train step loss rank shard save load weight learn token batch fast small good bad movie "
         "film great dull what which where when who why how is was of in on to and").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def squad(rng, questions, prefix):
    paragraphs = []
    for p in range(0, questions, 4):
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 80))]
        context = " ".join(words)
        qas = []
        for q in range(p, min(p + 4, questions)):
            start = rng.randrange(len(words) - 3)
            span = words[start:start + rng.randint(1, 3)]
            offset = len(" ".join(words[:start])) + (1 if start else 0)
            assert context[offset:offset + len(" ".join(span))] == " ".join(span)
            qas.append({"id": f"{prefix}{q}", "question": " ".join(rng.choice(WORDS) for _ in range(8)) + "?",
                        "answers": [{"text": " ".join(span), "answer_start": offset}]})
        paragraphs.append({"context": context, "qas": qas})
    return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}


def main(s3_dir, data_dir, train_questions, dev_questions):
    os.makedirs(s3_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(s3_dir, "bert-large-uncased-vocab.txt"), "w") as f:
        pieces = [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
        f.write("\n".join(SPECIAL + sorted(set(WORDS)) + ["?", "."] + pieces) + "\n")
    rng = random.Random(0)
    for name, n, prefix in (("train-v1.1.json", train_questions, "t"), ("dev-v1.1.json", dev_questions, "d")):
        with open(os.path.join(data_dir, name), "w") as f:
            json.dump(squad(rng, n, prefix), f)
    torch.save({"module": {}}, os.path.join(data_dir, "model.pt"))
    print(f"   SQuAD stand-ins: {train_questions} training and {dev_questions} dev questions in {data_dir}, "
          f"vocabulary in {s3_dir}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
