"""torch-geometric: node classification on a random graph with the library's model classes
(GCN and GAT add self loops: boolean masks and nonzero), the loss over the training nodes
(a boolean mask the loss closes over, as in PyG's examples)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.zoo import Built, Entry

NODES, EDGES, FEATURES, CLASSES, DROP = 256, 1024, 16, 4, 0.1


def node_classifier(model_cls: str, **kwargs: Any) -> Any:
    def build(seed: int) -> Built:
        from torch_geometric.nn import models

        torch.manual_seed(seed)
        model = getattr(models, model_cls)(in_channels=FEATURES, hidden_channels=32, num_layers=4,
                                           out_channels=CLASSES, dropout=DROP, **kwargs).train()
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(NODES, FEATURES, generator=g)
        edge_index = torch.randint(0, NODES, (2, EDGES), generator=g)
        y = torch.randint(0, CLASSES, (NODES,), generator=g)
        train_mask = torch.rand(NODES, generator=g) < 0.5

        def loss_fn(out: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out[train_mask], y[train_mask])

        return model, (x, edge_index), loss_fn
    return build


LIB = "torch_geometric"
ENTRIES = [
    Entry("pyg-gcn", LIB, node_classifier("GCN")),
    Entry("pyg-gat", LIB, node_classifier("GAT", heads=2)),
    Entry("pyg-sage", LIB, node_classifier("GraphSAGE")),
    Entry("pyg-gin", LIB, node_classifier("GIN")),
]
