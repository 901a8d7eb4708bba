"""hf_xmc models: one flat folder of remote-code-ready files (configuration_<m>.py + modeling_<m>.py).

Importing this package registers every model with the transformers Auto classes, both locally
(``AutoConfig.register`` / ``AutoModel.register``, so pip users never need remote code) and for remote code
(``register_for_auto_class``, so ``save_pretrained`` ships the modeling files and an ``auto_map``).
"""

from transformers import AutoConfig, AutoModel
from transformers.pipelines import PIPELINE_REGISTRY

from .classifier_head import ExtremeClassifier
from .configuration_dexml import DEXMLConfig
from .configuration_mufin import MUFINConfig
from .configuration_prime import PRIMEConfig
from .configuration_siamesexml import SiameseXMLConfig
from .configuration_unidec import UniDECConfig
from .configuration_xmc import XMCConfig
from .label_index import LabelIndex, faiss_available, faiss_gpu_available
from .modeling_dexml import DEXMLModel, DEXMLPreTrainedModel
from .modeling_mufin import MUFINModel, MUFINModelOutput, MUFINPreTrainedModel
from .modeling_prime import LabelPrototypeNetwork, PRIMEModel, PRIMEPreTrainedModel
from .modeling_siamesexml import BagOfEmbeddingsEncoder, ResidualBlock, SiameseXMLModel, SiameseXMLPreTrainedModel
from .modeling_unidec import UniDECModel, UniDECPreTrainedModel
from .modeling_xmc import XMCModelOutput, XMCPrediction, XMCPreTrainedModel
from .mufin_blocks import MUFINAttention, MUFINClassifier
from .mufin_label_store import label_centroids_from_embeddings
from .pipeline_xmc import XMC_PIPELINE_TASK, XMCPipeline
from .xmc_losses import (
    BCELoss,
    DecoupledSoftmaxLoss,
    InfoNCELoss,
    PRIMELoss,
    SoftmaxLoss,
    UniDECLoss,
    bce_loss,
    decoupled_softmax_loss,
    dynamic_margin_triplet,
    dynamic_margin_triplet_loss,
    get_loss,
    infonce_loss,
    prototype_regularizer,
    softmax_loss,
    symmetric_pool_loss,
)

MODEL_CLASSES = {
    "dexml": (DEXMLConfig, DEXMLModel),
    "mufin": (MUFINConfig, MUFINModel),
    "prime": (PRIMEConfig, PRIMEModel),
    "siamesexml": (SiameseXMLConfig, SiameseXMLModel),
    "unidec": (UniDECConfig, UniDECModel),
}

for _config_cls, _model_cls in MODEL_CLASSES.values():
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModel.register(_config_cls, _model_cls, exist_ok=True)
    _config_cls.register_for_auto_class()
    _model_cls.register_for_auto_class("AutoModel")

# pipeline(XMC_PIPELINE_TASK, model=<model object>) inside the package; saved directories name the pipeline in their config
PIPELINE_REGISTRY.register_pipeline(XMC_PIPELINE_TASK, pipeline_class=XMCPipeline, pt_model=AutoModel, type="multimodal")

__all__ = [
    "XMC_PIPELINE_TASK",
    "XMCPipeline",
    "BCELoss",
    "BagOfEmbeddingsEncoder",
    "DEXMLConfig",
    "DEXMLModel",
    "DEXMLPreTrainedModel",
    "DecoupledSoftmaxLoss",
    "ExtremeClassifier",
    "InfoNCELoss",
    "LabelIndex",
    "LabelPrototypeNetwork",
    "MODEL_CLASSES",
    "MUFINAttention",
    "MUFINClassifier",
    "MUFINConfig",
    "MUFINModel",
    "MUFINModelOutput",
    "MUFINPreTrainedModel",
    "PRIMEConfig",
    "PRIMELoss",
    "PRIMEModel",
    "PRIMEPreTrainedModel",
    "ResidualBlock",
    "SiameseXMLConfig",
    "SiameseXMLModel",
    "SiameseXMLPreTrainedModel",
    "SoftmaxLoss",
    "UniDECConfig",
    "UniDECLoss",
    "UniDECModel",
    "UniDECPreTrainedModel",
    "XMCConfig",
    "XMCModelOutput",
    "XMCPreTrainedModel",
    "XMCPrediction",
    "bce_loss",
    "decoupled_softmax_loss",
    "dynamic_margin_triplet",
    "dynamic_margin_triplet_loss",
    "faiss_available",
    "faiss_gpu_available",
    "get_loss",
    "infonce_loss",
    "label_centroids_from_embeddings",
    "prototype_regularizer",
    "softmax_loss",
    "symmetric_pool_loss",
]
