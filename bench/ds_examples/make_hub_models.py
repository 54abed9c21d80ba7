"""Stand-ins for the hub models and tokenizers DeepSpeedExamples' scripts name, made offline in a Hugging Face
hub cache (HF_HUB_CACHE), so from_pretrained("roberta-base") etc. find them with HF_HUB_OFFLINE=1: a tokenizer
trained on a small vocabulary and a model from the real architecture's config, shrunk (2 layers x 64).

usage: make_hub_models.py CACHE_DIR NAME...   (names: roberta-base bert-base-uncased bert-base-cased gpt2 gpt2-large
       meta-llama/Llama-2-7b openai/clip-vit-large-patch14)
Run it with the transformers the script will load them with (VisualChat's: transformers 4.36)."""
import json
import os
import shutil
import sys

import torch
from tokenizers import ByteLevelBPETokenizer, BertWordPieceTokenizer
import transformers as tf

WORDS = ("the a model data train step loss rank shard save load weight learn token batch fast small good bad "
         "movie film great dull").split()
TEXT = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def snapshot_dir(cache, name):
    """The folder to make the stand-in in, and the snapshot folder it becomes once complete (moved there whole, so
    that a run stopped halfway leaves no snapshot that looks made)."""
    repo = os.path.join(cache, "models--" + name.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    partial = os.path.join(repo, "partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return partial, os.path.join(repo, "snapshots", "0" * 40)


def bpe_tokenizer(specials, **names):
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=300, min_frequency=1, special_tokens=specials)
    return bpe, tf.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, **names)


def wordpiece_tokenizer(lower):
    wp = BertWordPieceTokenizer(lowercase=lower)
    wp.train_from_iterator(TEXT, vocab_size=200, min_frequency=1,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return wp


def make(cache, name):
    torch.manual_seed(0)  # the same weights in every run (uckpt's and DeepSpeed's compare from one model)
    out, snapshot = snapshot_dir(cache, name)
    if name == "roberta-base":
        bpe, tok = bpe_tokenizer(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", cls_token="<s>",
                                 sep_token="</s>")
        tok.save_pretrained(out)
        bpe.save_model(out)
        config = tf.RobertaConfig(vocab_size=len(tok), max_position_embeddings=514, pad_token_id=1, **SMALL)
        tf.RobertaForMaskedLM(config).save_pretrained(out)
    elif name in ("bert-base-uncased", "bert-base-cased"):
        wp = wordpiece_tokenizer(lower=name.endswith("uncased"))
        wp.save_model(out)
        tf.BertTokenizerFast(os.path.join(out, "vocab.txt"), do_lower_case=name.endswith("uncased")).save_pretrained(out)
        config = tf.BertConfig(vocab_size=wp.get_vocab_size(), **SMALL)
        tf.BertForPreTraining(config).save_pretrained(out)
    elif name in ("gpt2", "gpt2-large"):
        bpe, tok = bpe_tokenizer(["<|endoftext|>"], bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                 unk_token="<|endoftext|>")
        tok.save_pretrained(out)
        bpe.save_model(out)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        config = tf.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                               bos_token_id=eos, eos_token_id=eos)
        tf.GPT2LMHeadModel(config).save_pretrained(out)
    elif name == "meta-llama/Llama-2-7b":
        # Llama's tokenizer prepends <s> (VisualChat drops the first id of what it tokenizes)
        bpe, _ = bpe_tokenizer(["<unk>", "<s>", "</s>"])
        tok = tf.LlamaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                    unk_token="<unk>", add_bos_token=True)
        tok.save_pretrained(out)
        config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        tf.LlamaForCausalLM(config).save_pretrained(out)
    elif name == "openai/clip-vit-large-patch14":
        config = tf.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     image_size=224, patch_size=14, projection_dim=64)
        tf.CLIPVisionModel(config).save_pretrained(out)
        tf.CLIPImageProcessor(crop_size={"height": 224, "width": 224}, size={"shortest_edge": 224}).save_pretrained(out)
    else:
        raise SystemExit(f"make_hub_models.py: no stand-in for {name}")
    shutil.rmtree(snapshot, ignore_errors=True)
    os.makedirs(os.path.dirname(snapshot), exist_ok=True)
    os.rename(out, snapshot)
    print(f"   {name}: stand-in in {snapshot}")


if __name__ == "__main__":
    for model in sys.argv[2:]:
        make(sys.argv[1], model)
