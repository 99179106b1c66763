"""Byte-level BPE tokenizer trained offline on the corpus.

Byte-level means every string round-trips exactly, which the losslessness and
extraction tests rely on.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"  # ends a document and a chat turn alike
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN) + ROLE_TOKENS

# A simple template: the tiny model gets one so that chat prompts and the
# extraction CLI work the same way as with real chat models.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def train_tokenizer(texts: list[str] | tuple[str, ...], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                         special_tokens=list(SPECIAL_TOKENS),
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # BOS is added by the tokenizer itself, as Llama tokenizers do, so vLLM
    # and transformers produce identical ids for a prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int):
    """Write tokenizer.json + tokenizer_config.json as transformers expects."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length, chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(out_dir))
    return hf
