"""The model zoo used by the CLI, the memory planner and the benchmarks (no torchvision needed).

``build_model(name, **kw)``, ``model_input(name, batch_size, **kw)`` and ``default_loss(name)``
cover every name in ``MODEL_NAMES``; the builders are importable directly too.
"""

from __future__ import annotations

from superneurons.models.gpt import GPT, GPTConfig, gpt
from superneurons.models.lstm import CharLSTM, lstm
from superneurons.models.mlp import mlp
from superneurons.models.resnet import (
    BasicBlock,
    Bottleneck,
    ResNet,
    depth_to_n,
    n_to_depth,
    resnet,
    resnet50,
    resnet101,
    resnet152,
    resnet_deep,
)
from superneurons.models.vgg import ConvClassifier, alexnet, fc_heavy, vgg
from superneurons.models.zoo import MODEL_NAMES, build_model, default_loss, model_input

__all__ = [
    # zoo
    "MODEL_NAMES",
    "build_model",
    "default_loss",
    "model_input",
    # builders
    "alexnet",
    "depth_to_n",
    "fc_heavy",
    "gpt",
    "lstm",
    "mlp",
    "n_to_depth",
    "resnet",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnet_deep",
    "vgg",
    # classes
    "BasicBlock",
    "Bottleneck",
    "CharLSTM",
    "ConvClassifier",
    "GPT",
    "GPTConfig",
    "ResNet",
]
