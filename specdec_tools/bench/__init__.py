"""`specdec bench`: Spec-Bench prompts through the full gRPC stack, side by side
with the peers, in one run on one machine.

Systems, run interleaved (each prompt runs every system before the next prompt,
in orders that put each system first, and after each other system, equally often
(`running.run_order`), so drift in machine load and one run's after-effects are shared):
  spec-gN      speculative decoding through the services, fixed gamma N
  spec-auto    the same, gamma chosen per round by the coordinator's controller
               (drafts stop early after a token the drafter is unsure of), with
               the default hybrid proposer: n-gram lookups (free) and the model
  spec-auto-model  the same with the draft model alone (--no-model-only skips it)
  spec-auto-nostop  the same without that early stop (--ablate-confidence-stop)
  spec-gN-replica  (--replicate-gamma N) spec-gN once more, as a separate system:
               identical work, so its distance from spec-gN and from the best
               fixed gamma is the run's own noise floor
  target-only  the same services with speculation off
  target-only-bf16, spec-auto-bf16  (unless --no-bf16) a second stack with the
               target in bf16 (`specdec up --target-quantize none`): the
               precision where verifying rows is nearly free
  hf-generate  in-process transformers `generate()` with the target in bf16
  hf-assisted  in-process transformers assisted generation, `assistant_model=`
               the same (INT8) draft weights: the peer a user would otherwise pick
  llama-cpp    (--llama-cpp) llama.cpp through llama-cpp-python on the target's
               own GGUF file: the fastest CPU engine, target alone
  llama-cpp-spec  (--llama-cpp) the same with the pair's draft GGUF through the
               binding's draft hook (greedy drafts of 4 tokens)

Results are grouped by category and by Spec-Bench task: the eight MT-bench
categories pool into `mt_bench`, as Spec-Bench itself reports them; the other
five tasks are one category each.

Writes bench.json (every run, plus the summary), bench.md (a table per
category and temperature) and bench.png into --out.
"""
from specdec_tools.bench.data import Question, Run, load_questions, task_of
from specdec_tools.bench.report import reference_of, summarize
from specdec_tools.bench.running import main


__all__ = ["Question", "Run", "load_questions", "main", "reference_of", "summarize", "task_of"]
