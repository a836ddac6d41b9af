"""A local Hugging Face causal LM as a judge (``--task genppl --scorer``): the perplexity of
generated texts and MAUVE's features of them."""

from __future__ import annotations

from typing import Optional

from setdiff_dist.eval.tasks import EvalError


class HFScorer:
    """A local Hugging Face causal LM (``transformers``), as the paper scores samples with GPT-2
    Large: the per-token NLL of texts (after the model's BOS, or its end-of-text when it has no
    BOS) and MAUVE's features (the last layer's hidden state at each text's last token)."""

    def __init__(self, path: str, device: Optional[str] = None, max_length: int = 1024):
        import os

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise EvalError(f"--scorer {path}: not a Hugging Face model directory (no "
                            "config.json); give a local causal LM, e.g. GPT-2 Large saved with "
                            "save_pretrained, or a setdiff-convert --to-hf export")
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise EvalError("--task genppl scores with transformers, which is not installed: "
                            "pip install transformers") from None
        import torch

        self.torch = torch
        # the judge on the GPU when there is one, in bf16; on the CPU in fp32
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(device)
        self.model.eval()
        self.device, self.max_length = device, max_length
        bos = self.tok.bos_token_id if self.tok.bos_token_id is not None else \
            self.tok.eos_token_id
        if bos is None:
            raise EvalError(f"--scorer {path}: its tokenizer has neither a BOS nor an "
                            "end-of-text token to condition the first token on")
        self.bos = bos

    def ids(self, text: str) -> list:
        return [self.bos] + self.tok.encode(text, add_special_tokens=False)[:self.max_length - 1]

    def score(self, texts: list, nll: bool = True, features: bool = False):
        """``(sum of -log p over every text token, tokens, MAUVE's features [n, hidden] or
        None)`` (``nll=False``: the features only). The NLL conditions the first token on the
        BOS; the features are mauve-text's own (``featurize_tokens_from_model``): the text as
        its tokenizer encodes it (no token added, cut at ``max_length``), the last layer's
        hidden state at its last token, so that MAUVE is the number mauve-text computes from
        the texts with this model."""
        import numpy as np

        total, count, rows = 0.0, 0, []
        with self.torch.no_grad():
            for text in texts:
                ids = self.ids(text)
                if nll and len(ids) >= 2:
                    x = self.torch.tensor([ids], device=self.device)
                    total += self.model(x, labels=x).loss.item() * (len(ids) - 1)
                    count += len(ids) - 1
                if features:
                    own = self.tok.encode(text, truncation=True, max_length=self.max_length)
                    x = self.torch.tensor([own or [self.bos]], device=self.device)
                    out = self.model(x, output_hidden_states=True)
                    rows.append(out.hidden_states[-1][0, -1].float().cpu().numpy())
        return total, count, (np.stack(rows) if features else None)
