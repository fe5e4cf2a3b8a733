//! `Plane`: one channel of f32 samples, row-major. The currency between the stages that
//! work on masks and alphas (values in [0, 1]).

#[derive(Debug, Clone, PartialEq)]
pub struct Plane {
    pub width: u32,
    pub height: u32,
    pub data: Vec<f32>,
}

impl Plane {
    pub fn new(width: u32, height: u32, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), width as usize * height as usize);
        Self {
            width,
            height,
            data,
        }
    }

    pub fn filled(width: u32, height: u32, value: f32) -> Self {
        Self::new(width, height, vec![value; width as usize * height as usize])
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}
