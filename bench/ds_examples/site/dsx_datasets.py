"""datasets.load_dataset for the hub data sets DeepSpeedExamples' scripts name, offline: synthetic rows with the
columns and splits the real ones have (text of a few words from a small vocabulary, labels cycling). Any other
call (a local "json"/"csv" loader, a path) goes to the real datasets.load_dataset.

And datasets.load_metric, which datasets 3 removed (its metrics moved to the `evaluate` package, which downloads
them) and which datasets 2 downloads: "accuracy" and "glue" with a task, computing what GLUE's metric script returns
(accuracy; F1 too for mrpc and qqp; Matthews correlation for cola; Pearson and Spearman for stsb)."""
import os
import random

WORDS = ("the a model data train step loss rank shard save load weight learn token batch fast small good bad "
         "movie film great dull").split()
ROWS = int(os.environ.get("DSX_HUB_DATASETS_ROWS", "256"))

# GLUE's tasks: (text columns, label names; () = a float score), as the hub's glue data set has them
GLUE = {"cola": (("sentence",), ("unacceptable", "acceptable")), "sst2": (("sentence",), ("negative", "positive")),
        "mrpc": (("sentence1", "sentence2"), ("not_equivalent", "equivalent")),
        "qqp": (("question1", "question2"), ("not_duplicate", "duplicate")), "stsb": (("sentence1", "sentence2"), ()),
        "mnli": (("premise", "hypothesis"), ("entailment", "neutral", "contradiction")),
        "qnli": (("question", "sentence"), ("entailment", "not_entailment")),
        "rte": (("sentence1", "sentence2"), ("entailment", "not_entailment")),
        "wnli": (("sentence1", "sentence2"), ("not_entailment", "entailment"))}


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
        rows["label"] = [float(i % 5) if not labels else i % len(labels) for i in range(ROWS)]
        rows["idx"] = list(range(ROWS))
        return rows
    raise KeyError(name)


def _splits(name, config):
    if name == "glue" and config == "mnli":
        return ("train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched")
    return ("train", "validation", "test")


class _Metric:
    """add_batch / compute as datasets' Metric, for "accuracy" and GLUE's tasks."""

    def __init__(self, name, config):
        if name not in ("accuracy", "glue") or (name == "glue" and config not in GLUE and config != "mnli_matched"
                                                 and config != "mnli_mismatched"):
            raise NotImplementedError(f"the load_metric stand-in has accuracy and glue's tasks, not {name}/{config}")
        self.task = config if name == "glue" else "accuracy"
        self.predictions, self.references = [], []

    def add_batch(self, predictions=None, references=None):
        import numpy as np
        self.predictions += np.asarray(_numpy(predictions)).reshape(-1).tolist()
        self.references += np.asarray(_numpy(references)).reshape(-1).tolist()

    def compute(self, predictions=None, references=None):
        import numpy as np
        if predictions is not None:
            self.add_batch(predictions, references)
        p, r = np.asarray(self.predictions, dtype=float), np.asarray(self.references, dtype=float)
        self.predictions, self.references = [], []
        if self.task == "stsb":
            def ranks(x):
                return np.argsort(np.argsort(x)).astype(float)
            return {"pearson": float(np.corrcoef(p, r)[0, 1]),
                    "spearmanr": float(np.corrcoef(ranks(p), ranks(r))[0, 1])}
        if self.task == "cola":
            tp, tn = np.sum((p == 1) & (r == 1)), np.sum((p == 0) & (r == 0))
            fp, fn = np.sum((p == 1) & (r == 0)), np.sum((p == 0) & (r == 1))
            den = np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
            return {"matthews_correlation": float((tp * tn - fp * fn) / den) if den else 0.0}
        out = {"accuracy": float(np.mean(p == r)) if len(p) else 0.0}
        if self.task in ("mrpc", "qqp"):
            tp, fp, fn = np.sum((p == 1) & (r == 1)), np.sum((p == 1) & (r == 0)), np.sum((p == 0) & (r == 1))
            out["f1"] = float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0
        return out


def _numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def load_metric(path, config_name=None, *args, **kwargs):
    return _Metric(path, config_name)


def _features(path, name):
    """GLUE's columns as the hub's: labels a ClassLabel with the task's names (scripts read .names); else inferred."""
    if path != "glue":
        return None
    import datasets
    columns, labels = GLUE[name]
    features = {c: datasets.Value("string") for c in columns}
    features["label"] = datasets.ClassLabel(names=list(labels)) if labels else datasets.Value("float32")
    features["idx"] = datasets.Value("int32")
    return datasets.Features(features)


def install():
    import datasets
    real = datasets.load_dataset

    def load_dataset(path, name=None, *args, split=None, **kwargs):
        if path not in ("wikitext", "glue", "ptb_text_only"):
            return real(path, name, *args, split=split, **kwargs)
        seed = sum(map(ord, f"{path}/{name}"))
        built = {s: datasets.Dataset.from_dict(_rows(path, name, s, random.Random(seed + i)), features=_features(path, name))
                 for i, s in enumerate(_splits(path, name))}
        if split is not None:
            return built[split]
        return datasets.DatasetDict(built)

    datasets.load_dataset = load_dataset
    # datasets 2's own load_metric downloads the metric's script: replaced too
    datasets.load_metric = load_metric
