"""The migrator's rewrite rules, one codemod per file, in the order they are applied."""

from skills.migrator.rules.absolute_imports import AbsoluteImports
from skills.migrator.rules.attention_class_table import AttentionClassTable
from skills.migrator.rules.cache_keys import CacheKeys
from skills.migrator.rules.cache_params import CacheParams
from skills.migrator.rules.cache_query_positions import CacheQueryPositions
from skills.migrator.rules.causal_lm_entry import CausalLMEntry
from skills.migrator.rules.checkpoint_branches import CheckpointBranches
from skills.migrator.rules.classvar_annotations import ClassVarAnnotations
from skills.migrator.rules.constructor_defaults import ConstructorDefaults
from skills.migrator.rules.constructor_plumbing import ConstructorPlumbing
from skills.migrator.rules.dead_code import DeadCode
from skills.migrator.rules.depth_attention import DepthAttention
from skills.migrator.rules.distance_bias import DistanceBias
from skills.migrator.rules.drop_dropout import DropDropout
from skills.migrator.rules.fold_hf_only_params import FoldHFOnlyParams
from skills.migrator.rules.fused_act_and_mul import FusedActAndMul
from skills.migrator.rules.fused_rms_norm import FusedRMSNorm
from skills.migrator.rules.fused_rotary_embedding import FusedRotaryEmbedding
from skills.migrator.rules.hand_written_attention import HandWrittenAttention
from skills.migrator.rules.honest_signatures import HonestSignatures
from skills.migrator.rules.key_bias_mask import KeyBiasMask
from skills.migrator.rules.lambda_modules import LambdaModules
from skills.migrator.rules.latent_kv_cache import LatentKVCache
from skills.migrator.rules.list_outputs import ListOutputs
from skills.migrator.rules.model_outputs import ModelOutputs
from skills.migrator.rules.module_bases import ModuleBases
from skills.migrator.rules.module_dict_model import ModuleDictModel
from skills.migrator.rules.plain_linear_subclasses import PlainLinearSubclasses
from skills.migrator.rules.prune_unreachable import PruneUnreachable
from skills.migrator.rules.remove_mask_machinery import RemoveMaskMachinery
from skills.migrator.rules.request_rope_update import RequestRopeUpdate
from skills.migrator.rules.request_states import PerRequestStates
from skills.migrator.rules.runtime_attention import RuntimeAttention
from skills.migrator.rules.shared_inputs import SharedInputs
from skills.migrator.rules.sparse_indexer import SparseIndexer
from skills.migrator.rules.stale_docs import StaleDocs
from skills.migrator.rules.strip_hf_decorators import StripHFDecorators
from skills.migrator.rules.tiled_kv_heads import TiledKVHeads
from skills.migrator.rules.unread_modules import UnreadModules
from skills.migrator.rules.unused_imports import UnusedImports
from skills.migrator.rules.unused_parameters import UnusedParameters

MODELING_RULES = [
    AbsoluteImports,
    StripHFDecorators,
    ModuleDictModel,
    LambdaModules,
    RemoveMaskMachinery,
    CacheParams,
    CacheKeys,
    SparseIndexer,
    PerRequestStates,
    CacheQueryPositions,
    DistanceBias,
    DepthAttention,
    FoldHFOnlyParams,
    AttentionClassTable,
    HandWrittenAttention,
    KeyBiasMask,
    RuntimeAttention,
    LatentKVCache,
    TiledKVHeads,
    ModelOutputs,
    CausalLMEntry,
    ModuleBases,
    PlainLinearSubclasses,
    FusedRMSNorm,
    FusedRotaryEmbedding,
    FusedActAndMul,
    ConstructorPlumbing,
    PruneUnreachable,
    DropDropout,
    CheckpointBranches,
    RequestRopeUpdate,
    UnreadModules,
    ConstructorDefaults,
    ListOutputs,
    SharedInputs,
    DeadCode,
    UnusedParameters,
    HonestSignatures,
    UnusedImports,
    StaleDocs,
]
CONFIGURATION_RULES = [AbsoluteImports, StripHFDecorators, UnusedImports, StaleDocs, ClassVarAnnotations]
# In the order they run: the modeling file's rules, then those only the configuration file gets.
MIGRATE_RULES = [*MODELING_RULES, *(r for r in CONFIGURATION_RULES if r not in MODELING_RULES)]
