"""Parameter-efficient fine-tuning with Hugging Face ``peft``: which adapters the private step can train, and the
refusal of those it cannot (docs/algorithms.md, "What is private").

Nothing here imports ``peft``: its layers are recognised by the module their class comes from.

**What works.** Plain LoRA on ``nn.Linear``, ``nn.Conv1d/2d/3d`` and transformers' ``Conv1D`` targets: peft keeps a
frozen copy of the target (``base_layer``) and adds ``lora_B(lora_A(dropout(x))) * scaling`` to its output, where
``lora_A`` and ``lora_B`` are ordinary ``nn.Linear`` (or convolution) layers, called as layers, on a batch along dim
0. The per-sample path hooks only layers that own a parameter with ``requires_grad`` (the frozen base is never
hooked, gets no per-sample work, no noise and no gradient), so a LoRA step clips and noises a vector of the
adapters' size, and its cost is that of a non-private LoRA step plus the per-sample norms of the adapters.
``modules_to_save`` (a trainable copy of a head or a norm) works if that layer has a per-sample path.

**What is refused**, because no per-sample hook can see how the adapter parameters are used:

- adapters kept as raw parameters (an ``nn.ParameterDict`` read directly in the peft layer's forward): LoRA on an
  embedding target (``lora_embedding_A`` / ``lora_embedding_B``), IA3, VeRA, AdaLoRA, LoHa, trainable tokens and most
  other peft methods;
- LoRA variants (``use_dora=True``, aLoRA, ...): DoRA's magnitude rescales by the column norm of ``W + B A``, which
  reads ``lora_A.weight`` and ``lora_B.weight`` outside their layers; the other variants change the forward in ways
  not verified here;
- prompt learning (prompt tuning, prefix tuning, P-tuning): peft computes the virtual tokens' embeddings once and
  repeats them for every record, so the per-sample gradients are not per record.
"""

from __future__ import annotations

from torch import nn


def _from_peft(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def adapter_problems(module: nn.Module) -> list[str]:
    """Why the peft adapters in ``module`` cannot be trained privately, one line per offending layer (empty if
    there are no peft layers, or only supported ones).

    Example:
        >>> from torch import nn
        >>> adapter_problems(nn.Linear(2, 2))  # no peft layer: nothing to say
        []
    """
    problems: list[str] = []
    for name, layer in module.named_modules():
        if not _from_peft(layer):
            continue
        label = f"{name or '<root>'} ({type(layer).__name__})"
        configs = getattr(layer, "peft_config", None)
        if isinstance(configs, dict) and any(getattr(c, "is_prompt_learning", False) for c in configs.values()):
            problems.append(
                f"{label}: peft's prompt learning (prompt tuning, prefix tuning, P-tuning) computes the virtual "
                "tokens once for the whole batch and repeats them for every record, so no per-sample gradient of "
                f"them is per record; {_FIX}"
            )
            continue
        variants = getattr(layer, "lora_variant", None)
        if isinstance(variants, dict) and variants and _trainable(layer):
            kinds = ", ".join(sorted({type(v).__name__ for v in variants.values()}))
            problems.append(
                f"{label}: LoRA variant {kinds} (use_dora=True or another variant of LoraConfig): DoRA rescales by "
                "the column norm of W + B A, which reads lora_A's and lora_B's weights outside their layers where no "
                f"per-sample hook sees them, and the other variants are not verified; {_FIX}"
            )
            continue
        for attribute in getattr(layer, "adapter_layer_names", ()):
            held = getattr(layer, attribute, None)
            if isinstance(held, (nn.ParameterDict, nn.ParameterList)) and _trainable(held):
                problems.append(
                    f"{label}: its adapter parameters {attribute!r} are raw parameters that the peft layer reads "
                    "directly in its forward (LoRA on an embedding target, IA3, VeRA, AdaLoRA, LoHa, ...), where no "
                    f"per-sample hook sees them; {_FIX}"
                )
    return problems


_FIX = (
    "use plain LoRA (peft.LoraConfig without use_dora or other variants) with target_modules naming linear or "
    "convolution layers only (for GPT-2: c_attn, c_proj, c_fc; no embedding such as wte)"
)
