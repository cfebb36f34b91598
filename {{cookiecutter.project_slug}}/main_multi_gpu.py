{#
main_multi_gpu.py, section by section: each include is one part of the generated file,
in order, from templates/main_multi_gpu/. What differs by `parallelism` or `launcher`
lives in the folder named after the choice (ddp/ or fsdp2/, torchrun/ or spawn/), as
macros the sections call: `par.NAME()` (training), `saving.NAME()` (the checkpoint
format) and `launcher.NAME()`. An `{% if %}` on those two choices is left only where one
choice adds lines that the other has no version of (an import, an FSDP2-only helper).
The README's "Maintaining the template" says how to check a change against every variant.
#}
{% set spawn = cookiecutter.launcher == "spawn" %}
{% set multi = cookiecutter.nodes == "multi" %}
{% set strategy = cookiecutter.save_strategy %}
{% set fsdp = cookiecutter.parallelism == "fsdp2" %}
{% set parallelism = "main_multi_gpu/" ~ cookiecutter.parallelism %}
{% import parallelism ~ "/training.py" as par with context %}
{% import parallelism ~ "/checkpoints.py" as saving with context %}
{% import "main_multi_gpu/" ~ cookiecutter.launcher ~ "/launching.py" as launcher with context %}
{# The opening comment, the module docstring, the imports #}
{% include "main_multi_gpu/head.py" %}
{# EDIT HERE: the five functions a user rewrites #}
{% include "main_multi_gpu/edit_here.py" %}
{# The training loop, and the four DDP changes: run(), the process group, train(),
   a pass, what falls due after an update, writing checkpoints #}
{% include "main_multi_gpu/training_loop.py" %}
{# ... continued: building the data, the loaders and the (wrapped or sharded) model #}
{% include "main_multi_gpu/data_and_model.py" %}
{# ... continued: the loss sums, an update, the checks, evaluation #}
{% include "main_multi_gpu/steps_and_evaluation.py" %}
{# Checkpoints and resuming #}
{% include "main_multi_gpu/checkpoints.py" %}
{# Reports: progress, metrics.csv, the time per epoch, the trackers, preflight #}
{% include "main_multi_gpu/reports.py" %}
{# The command line #}
{% include "main_multi_gpu/command_line.py" %}
{# Stops, failures and hangs: say which rank, and where #}
{% include "main_multi_gpu/failures.py" %}
{# Launching: torchrun inside this process, or torch.multiprocessing #}
{{ launcher.launching() }}
