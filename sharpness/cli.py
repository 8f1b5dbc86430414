"""Command-line pieces shared by ``python -m sharpness`` and ``python -m landscape``: the model, checkpoint,
data, loss and dtype arguments, their safe loaders, the error types that mean bad input, and the training loop of
their built-in examples (``landscape demo``, ``sharpness study --builtin``)."""

from sharpness._cli import DTYPES as DTYPES
from sharpness._cli import USER_ERRORS as USER_ERRORS
from sharpness._cli import OneLineParser as OneLineParser
from sharpness._cli import add_evaluation_arguments as add_evaluation_arguments
from sharpness._cli import add_model_arguments as add_model_arguments
from sharpness._cli import add_quiet_argument as add_quiet_argument
from sharpness._cli import add_solver_arguments as add_solver_arguments
from sharpness._cli import check_outputs as check_outputs
from sharpness._cli import command_inputs as command_inputs
from sharpness._cli import load_model as load_model
from sharpness._cli import load_problem as load_problem
from sharpness._cli import memory_budget as memory_budget
from sharpness._cli import run_command as run_command
from sharpness._cli import start_objective as start_objective
from sharpness._launch import launched_processes as launched_processes
from sharpness._resnet import resnet as resnet
from sharpness._specs import SpecError as SpecError
from sharpness._specs import build_model as build_model
from sharpness._specs import lenet as lenet
from sharpness._specs import load_checkpoint as load_checkpoint
from sharpness._specs import load_data as load_data
from sharpness._specs import mlp as mlp
from sharpness._training import TrainingRun as TrainingRun
from sharpness._training import train_to_loss as train_to_loss

__all__ = [
    "DTYPES",
    "USER_ERRORS",
    "OneLineParser",
    "SpecError",
    "TrainingRun",
    "add_evaluation_arguments",
    "add_model_arguments",
    "add_quiet_argument",
    "add_solver_arguments",
    "build_model",
    "check_outputs",
    "command_inputs",
    "launched_processes",
    "lenet",
    "load_checkpoint",
    "load_data",
    "load_model",
    "load_problem",
    "memory_budget",
    "mlp",
    "resnet",
    "run_command",
    "start_objective",
    "train_to_loss",
]
