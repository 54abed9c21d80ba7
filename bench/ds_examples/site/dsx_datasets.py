"""datasets.load_dataset for the hub data sets DeepSpeedExamples' scripts name, offline: synthetic rows with the
columns and splits the real ones have (text of a few words from a small vocabulary, labels cycling). Any other
call (a local "json"/"csv" loader, a path) goes to the real datasets.load_dataset."""
import os
import random

WORDS = ("the a model data train step loss rank shard save load weight learn token batch fast small good bad "
         "movie film great dull").split()
ROWS = int(os.environ.get("DSX_HUB_DATASETS_ROWS", "256"))

# GLUE's tasks: (text columns, number of labels; 0 = a float score), as the hub's glue data set has them
GLUE = {"cola": (("sentence",), 2), "sst2": (("sentence",), 2), "mrpc": (("sentence1", "sentence2"), 2),
        "qqp": (("question1", "question2"), 2), "stsb": (("sentence1", "sentence2"), 0),
        "mnli": (("premise", "hypothesis"), 3), "qnli": (("question", "sentence"), 2),
        "rte": (("sentence1", "sentence2"), 2), "wnli": (("sentence1", "sentence2"), 2)}


def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _rows(name, config, split, rng):
    if name == "wikitext":
        return {"text": [(" " + _text(rng, rng.randint(8, 40)) + " \n") if i % 4 else "" for i in range(ROWS)]}
    if name == "ptb_text_only":  # one lower-case sentence a row, as Penn Treebank's text-only data set
        return {"sentence": [_text(rng, rng.randint(8, 30)) for _ in range(ROWS)]}
    if name == "glue":
        columns, labels = GLUE[config]
        rows = {c: [_text(rng, rng.randint(4, 16)) for _ in range(ROWS)] for c in columns}
        rows["label"] = [float(i % 5) if labels == 0 else i % labels for i in range(ROWS)]
        rows["idx"] = list(range(ROWS))
        return rows
    raise KeyError(name)


def _splits(name, config):
    if name == "glue" and config == "mnli":
        return ("train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched")
    return ("train", "validation", "test")


def install():
    import datasets
    real = datasets.load_dataset

    def load_dataset(path, name=None, *args, split=None, **kwargs):
        if path not in ("wikitext", "glue", "ptb_text_only"):
            return real(path, name, *args, split=split, **kwargs)
        seed = sum(map(ord, f"{path}/{name}"))
        built = {s: datasets.Dataset.from_dict(_rows(path, name, s, random.Random(seed + i)))
                 for i, s in enumerate(_splits(path, name))}
        if split is not None:
            return built[split]
        return datasets.DatasetDict(built)

    datasets.load_dataset = load_dataset
