#!/usr/bin/env python
"""Train PRIME (label prototype network + clipped dynamic-margin triplet loss) on Extreme Classification Repository files.

    python training_scripts/train_prime.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/prime

    accelerate launch --num_processes 2 training_scripts/train_prime.py ...   # several processes

Before the first step the trainer clusters the label embeddings onto the free vectors and sets every label's
centroid from its training queries (initial encoder); both are saved with the model. Writes OUT/ (a model directory
loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), prototype index included) and
OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k, test_R@10/100, train_runtime, test_samples_per_second).

Defaults are PRIME's recipe at a short budget: 2 positives per query drawn by inverse propensity (--num_positives 1
gives PRIME-lite), NGAME cluster batching from the second epoch (--cluster_batching false for random batches), the
spec's loss constants. Every TrainingArguments flag works, and so do the engine flags of XMCTrainingArguments.
"""

# The recipe lives in the package (hf_xmc/training/recipes/prime.py) so that `hf-xmc train prime` runs the same code.
from hf_xmc.training.recipes.prime import main

if __name__ == "__main__":
    import sys

    from hf_xmc.training.script_utils import run_script

    sys.exit(run_script(main))  # an input fault: one line and exit status 2 (--debug: the traceback)
