# {{ cookiecutter.project_name }}
{% from "version.jinja" import version %}
# From the DDP template, version {{ version }}; with cruft, .cruft.json names the commit
{{ par.intro() }}
# Your data, model, loss, metrics and optimizer go in the five functions under
# "EDIT HERE"; nothing else in this file needs to change for them.
{{ par.docstring() }}

import argparse
import atexit
import contextlib
import copy
import csv
import ctypes
import faulthandler
import functools
import gc
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import queue
import random
import re
import select
{% if not spawn %}
import shlex
{% endif %}
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sized
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
{% if fsdp %}
import torch.distributed.checkpoint as dcp
{% endif %}
{% if spawn %}
import torch.multiprocessing as mp
{% endif %}
import torch.nn.functional as F
from torch import nn
{% if fsdp %}
from torch.distributed import fsdp  # FSDP2's: 2.7 and newer (see parse_args)
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
{% endif %}
{% if not spawn %}
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
{% if multi %}
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
{% else %}
from torch.distributed.elastic.rendezvous import RendezvousError
{% endif %}
{% endif %}
{% if not spawn %}
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun
{% endif %}
{% if not fsdp %}
from torch.nn.parallel import DistributedDataParallel as DDP
{% endif %}
from torch.utils._pytree import tree_map
{% if cookiecutter.use_batch_sampler %}
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)
{% else %}
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)
{% endif %}
from torch.utils.data._utils.pin_memory import pin_memory

