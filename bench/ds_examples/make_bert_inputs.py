"""GLUE RTE's files as the BERT GLUE scripts of bing_bert and BingBertGlue read them, made offline: DIR/train.tsv
and DIR/dev.tsv, tab-separated with a header row, columns index, sentence1, sentence2, label (entailment or
not_entailment, alternating); the sentences are words of the stand-in vocabulary (make_squad_inputs.py's).

usage: make_bert_inputs.py DIR TRAIN_ROWS DEV_ROWS"""
import os
import random
import sys

from make_squad_inputs import WORDS


def write(path, rows, rng):
    with open(path, "w") as f:
        f.write("index\tsentence1\tsentence2\tlabel\n")
        for i in range(rows):
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))
            b = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            f.write(f"{i}\t{a}\t{b}\t{('entailment', 'not_entailment')[i % 2]}\n")


if __name__ == "__main__":
    out, train, dev = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.makedirs(out, exist_ok=True)
    write(os.path.join(out, "train.tsv"), train, random.Random(0))
    write(os.path.join(out, "dev.tsv"), dev, random.Random(1))
    print(f"   RTE stand-in: {train} + {dev} rows in {out}")
