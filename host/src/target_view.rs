//! The target as drafters see it: the host's implementation of the plugin API's TargetView.

use std::cell::RefCell;
use std::rc::Rc;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{ROption, RResult, RStr};
use mlx_rs::Array;
use plugin_api::abi::Extension;
use plugin_api::target::{DonorLayer, Donors, LayerKind, TargetInfo, TargetViewAbi, TargetViewAbi_TO, TargetViewBox};
use plugin_api::{ArrayRef, OwnedArray, PluginError, Ports};

use crate::model::config::LayerType;
use crate::model::{Gemma4, LayerCache};

/// The target model and the caches of the request being generated (empty until it starts),
/// serving only the ports the drafter declared.
#[derive(Clone)]
pub struct TargetView {
    model: Rc<Gemma4>,
    caches: Rc<RefCell<Vec<LayerCache>>>,
    ports: Ports,
}

impl TargetView {
    pub fn new(model: Rc<Gemma4>, caches: Rc<RefCell<Vec<LayerCache>>>, ports: Ports) -> Self {
        TargetView { model, caches, ports }
    }

    /// Refuses a call to a port the drafter did not declare in its capabilities.
    fn check_port(&self, port: Ports) -> Result<(), PluginError> {
        if self.ports.contains(port) {
            return Ok(());
        }
        Err(PluginError::invalid_argument(format!(
            "the target's `{}` port was not declared in the drafter's capabilities (declared: {})",
            port.names().join(", "),
            if self.ports == Ports::NONE { "none".to_owned() } else { self.ports.names().join(", ") }
        )))
    }

    pub fn boxed(&self) -> TargetViewBox {
        TargetViewAbi_TO::from_value(self.clone(), TD_Opaque)
    }

    pub fn info_of(model: &Gemma4) -> TargetInfo {
        let c = &model.config;
        TargetInfo {
            model_type: c.model_type.as_str().into(),
            vocab_size: c.vocab_size as u32,
            hidden_size: c.hidden_size as u32,
            num_layers: c.num_hidden_layers as u32,
            num_attention_heads: c.num_attention_heads as u32,
            num_key_value_heads: c.num_key_value_heads as u32,
            head_dim: c.head_dim as u32,
            global_head_dim: c.global_head_dim as u32,
            layer_kinds: c
                .layer_types
                .iter()
                .map(|t| match t {
                    LayerType::Sliding => LayerKind::SLIDING,
                    LayerType::Full => LayerKind::FULL,
                })
                .collect(),
            first_kv_shared_layer: c.first_kv_shared_layer() as u32,
            sliding_window: c.sliding_window as u32,
            dtype: model.dtype as u32,
            final_logit_softcap: c.final_logit_softcapping.unwrap_or(0.0),
        }
    }

    fn donor(&self, layer_type: LayerType) -> Result<DonorLayer, PluginError> {
        let c = &self.model.config;
        let layer = (0..c.first_kv_shared_layer())
            .rev()
            .find(|&i| c.layer_type(i) == layer_type)
            .ok_or_else(|| PluginError::unsupported(format!("the target has no {layer_type:?} donor layer")))?;
        let caches = self.caches.borrow();
        let cache = caches.get(layer).ok_or_else(|| PluginError::invalid_argument("no request is being generated"))?;
        let (keys, values, slots) =
            cache.storage().ok_or_else(|| PluginError::invalid_argument("the target cache is still empty"))?;
        Ok(DonorLayer {
            keys: OwnedArray::new(keys.clone()),
            values: OwnedArray::new(values.clone()),
            slot_positions: OwnedArray::new(Array::from_slice(
                &slots.iter().flatten().copied().collect::<Vec<i32>>(),
                &[slots.len() as i32, slots.first().map_or(0, Vec::len) as i32],
            )),
            window: cache.window().unwrap_or(0) as u32,
        })
    }
}

fn result(r: Result<Array, mlx_rs::error::Exception>) -> RResult<OwnedArray, PluginError> {
    r.map(OwnedArray::new).map_err(PluginError::from).into()
}

impl TargetViewAbi for TargetView {
    fn info(&self) -> TargetInfo {
        Self::info_of(&self.model)
    }

    fn embed(&self, ids: ArrayRef<'_>, scaled: bool) -> RResult<OwnedArray, PluginError> {
        if let Err(e) = self.check_port(Ports::EMBED) {
            return RResult::RErr(e);
        }
        result(self.model.embed(&ids.to_array(), scaled))
    }

    fn logits_from_hidden(&self, hidden: ArrayRef<'_>) -> RResult<OwnedArray, PluginError> {
        if let Err(e) = self.check_port(Ports::LOGITS) {
            return RResult::RErr(e);
        }
        result(self.model.logits_from_hidden(&hidden.to_array()))
    }

    fn extension(&self, _id: RStr<'_>) -> ROption<Extension> {
        ROption::RNone
    }

    fn read_donors(&self) -> RResult<Donors, PluginError> {
        let positions: Vec<i32> =
            self.caches.borrow().first().map_or(Vec::new(), |c| c.offsets().iter().map(|&o| o as i32 - 1).collect());
        let donors = (|| {
            self.check_port(Ports::DONORS)?;
            Ok(Donors {
                positions: positions.into(),
                sliding: self.donor(LayerType::Sliding)?,
                full: self.donor(LayerType::Full)?,
            })
        })();
        donors.into()
    }
}
