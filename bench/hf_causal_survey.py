"""Which Hugging Face architectures the causality check (src/models/hf.py) accepts,
refuses, or cannot probe: every model type that the installed transformers'
``AutoModelForCausalLM`` maps, at its default config, through the same probe the
config check runs (layers cut to 2, widths to 32, on CPU, seeded).

    python -m bench.hf_causal_survey

Prints one line per model type (``causal``, ``NOT causal <how far later tokens move
earlier logits>``, ``encoder-decoder`` (refused by its flag), ``no probe`` (the run
warns and goes on), ``no config``), then the counts and the refused types.
"""

from __future__ import annotations

import argparse
import warnings
from collections import defaultdict


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from src.models.hf import _later_inputs_reach

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    mapped = AutoModelForCausalLM._model_mapping.keys()
    types = sorted({getattr(c, "model_type", None) for c in mapped} - {None, ""})
    verdicts: dict[str, list[str]] = defaultdict(list)
    for model_type in types:
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:
            verdict = "no config"
        else:
            if getattr(config, "is_encoder_decoder", False):
                verdict = "encoder-decoder"
            else:
                config.use_cache = False
                reach = _later_inputs_reach(config, False)
                if reach is None:
                    verdict = "no probe"
                elif reach > 1e-5:
                    verdict = "NOT causal"
                    print(f"{model_type:30s} NOT causal {reach:.1e}", flush=True)
                else:
                    verdict = "causal"
        if verdict != "NOT causal":
            print(f"{model_type:30s} {verdict}", flush=True)
        verdicts[verdict].append(model_type)
    print(f"\n{len(types)} model types:")
    for verdict, names in sorted(verdicts.items()):
        print(f"  {verdict}: {len(names)}")
    for verdict in ("NOT causal", "no probe"):
        print(f"{verdict}: {' '.join(verdicts[verdict])}")


if __name__ == "__main__":
    main()
