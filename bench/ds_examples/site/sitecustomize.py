"""Offline stand-ins for what DeepSpeedExamples' scripts would download, switched on by environment variables
(bench/ds-examples-gpu.sh sets them per case); nothing here changes a script.

  DSX_FAKEDATA_SIZE  caps torchvision.datasets.FakeData (imagenet's --dummy asks for ImageNet's 1,281,167 images)
  DSX_CIFAR          torchvision.datasets.CIFAR10 / CIFAR100 give N synthetic 32x32 RGB PIL images (labels
                     cycling over the classes) instead of downloading; DSX_CIFAR_TEST for the test split
  DSX_HUB_DATASETS   datasets.load_dataset(NAME, ...) for a hub data set gives synthetic text rows of its shape
                     (see dsx_datasets.py); a local loader ("json", "csv", a path) is the real one
  DSX_S3_BERT        a folder: pytorch_pretrained_bert's downloads from BERT's S3 folder
                     (https://s3.amazonaws.com/models.huggingface.co/bert/NAME: a HEAD for its ETag, then a GET) are
                     answered with the folder's file NAME where it has one (BingBertSquad's vocabulary); any other
                     request goes to the network as before
  DSX_TIMM_SEEDED    timm 0.x's pretrained weights (create_model(..., pretrained=True), a download) are not loaded:
                     the model keeps its own seeded initialisation (data_efficiency/vit_finetuning's ViT-B/16)
  DSX_TRANSFORMERS4  three names of transformers 4 that transformers 5 dropped, which the scripts import (the
                     environment's transformers is newer than they are; nothing here stands in for DeepSpeed):
                     transformers.modeling_utils.no_init_weights (now transformers.initialization's; DeepSpeed-Chat)
                     transformers.modeling_utils.Conv1D (now transformers.pytorch_utils'; compression/gpt2)
                     and transformers.AdamW (its own AdamW, deprecated in 4 for torch.optim.AdamW: the same update
                     with its defaults, eps=1e-6 and correct_bias=True; VisualChat, compression/gpt2)
"""
import os


def _patch_fakedata():
    import torchvision.datasets as datasets
    init = datasets.FakeData.__init__

    def capped(self, size=1000, *args, **kwargs):
        init(self, min(size, int(os.environ["DSX_FAKEDATA_SIZE"])), *args, **kwargs)

    datasets.FakeData.__init__ = capped


def _synthetic_cifar(num_classes):
    import numpy as np
    import torch.utils.data
    from PIL import Image

    class SyntheticCIFAR(torch.utils.data.Dataset):
        """CIFAR-%d's shape: HxWxC uint8 images as PIL images, integer labels; seeded, no download.""" % num_classes

        def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False):
            n = int(os.environ.get("DSX_CIFAR" if train else "DSX_CIFAR_TEST", 512 if train else 64))
            rng = np.random.default_rng(0 if train else 1)
            self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            self.targets = [i % num_classes for i in range(n)]
            self.classes = [f"class{i}" for i in range(num_classes)]
            self.root, self.train = root, train
            self.transform, self.target_transform = transform, target_transform

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            img, target = Image.fromarray(self.data[i]), self.targets[i]
            if self.transform is not None:
                img = self.transform(img)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return img, target

    return SyntheticCIFAR


def _patch_cifar():
    import torchvision.datasets as datasets
    datasets.CIFAR10 = _synthetic_cifar(10)
    datasets.CIFAR100 = _synthetic_cifar(100)


def _serve_s3_bert():
    import io

    import requests.adapters
    import requests.structures

    prefix = "https://s3.amazonaws.com/models.huggingface.co/bert/"
    folder = os.environ["DSX_S3_BERT"]
    send = requests.adapters.HTTPAdapter.send

    def send_local(self, request, **kwargs):
        path = os.path.join(folder, request.url[len(prefix):]) if request.url.startswith(prefix) else None
        if path is None or not os.path.isfile(path):
            return send(self, request, **kwargs)
        with open(path, "rb") as f:
            body = f.read()
        response = requests.Response()
        response.status_code, response.reason, response.url, response.request = 200, "OK", request.url, request
        response.headers = requests.structures.CaseInsensitiveDict(
            {"ETag": '"dsx-stand-in"', "Content-Length": str(len(body))})
        response.raw = io.BytesIO(b"" if request.method == "HEAD" else body)
        return response

    requests.adapters.HTTPAdapter.send = send_local


def _timm_seeded():
    import timm.models.helpers as helpers

    def skip(model, *args, **kwargs):
        print(f"sitecustomize: DSX_TIMM_SEEDED: no pretrained weights for {type(model).__name__} (seeded init kept)")

    helpers.load_pretrained = skip
    helpers.load_custom_pretrained = skip


def _patch_hub_datasets():
    import dsx_datasets
    dsx_datasets.install()


def _transformers4_names():
    import transformers.initialization
    import transformers.modeling_utils
    if not hasattr(transformers.modeling_utils, "no_init_weights"):
        transformers.modeling_utils.no_init_weights = transformers.initialization.no_init_weights
    import transformers.pytorch_utils
    if not hasattr(transformers.modeling_utils, "Conv1D"):
        transformers.modeling_utils.Conv1D = transformers.pytorch_utils.Conv1D
    try:
        transformers.AdamW
    except (AttributeError, ImportError):
        import torch

        class AdamW(torch.optim.AdamW):
            """transformers 4's AdamW: torch's with eps=1e-6 by default; correct_bias=False (no bias correction) has
            no torch counterpart and is refused."""

            def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                         no_deprecation_warning=False):
                if not correct_bias:
                    raise NotImplementedError("the transformers.AdamW stand-in has no correct_bias=False")
                super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

        transformers.AdamW = AdamW


for var, patch in (("DSX_TRANSFORMERS4", _transformers4_names), ("DSX_FAKEDATA_SIZE", _patch_fakedata), ("DSX_CIFAR", _patch_cifar),
                   ("DSX_HUB_DATASETS", _patch_hub_datasets), ("DSX_S3_BERT", _serve_s3_bert),
                   ("DSX_TIMM_SEEDED", _timm_seeded)):
    if os.environ.get(var):
        try:
            patch()
        except ImportError as e:  # the script then fails on the import itself, naming it
            print(f"sitecustomize: {var} stand-in not installed: {e}")
