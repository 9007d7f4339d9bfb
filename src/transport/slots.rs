//! Values kept under small integer ids that are reused once released: the local region tables of
//! the P2P and libfabric endpoints, the striped endpoint's, and the libfabric registrations.
//! A registration per `mscclppRegisteredBufferWrite` call then does not grow a table past what
//! is held at once.

/// A table of `T` under ids handed out by `insert`; a removed id is handed out again first.
#[derive(Debug)]
pub struct Slots<T> {
    items: Vec<Option<T>>,
    /// Ids of removed entries, reused first.
    free: Vec<usize>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            items: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slots<T> {
    /// Keeps `t` (in a removed id's place if there is one); returns its id.
    pub fn insert(&mut self, t: T) -> usize {
        match self.free.pop() {
            Some(id) => {
                self.items[id] = Some(t);
                id
            }
            None => {
                self.items.push(Some(t));
                self.items.len() - 1
            }
        }
    }

    /// The value under `id`, if held.
    pub fn get(&self, id: usize) -> Option<&T> {
        self.items.get(id).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, id: usize) -> Option<&mut T> {
        self.items.get_mut(id).and_then(Option::as_mut)
    }

    /// Takes the value under `id` if it is held and `keep_out` says so; its id is then free.
    pub fn remove_if(&mut self, id: usize, keep_out: impl FnOnce(&T) -> bool) -> Option<T> {
        let slot = self.items.get_mut(id)?;
        if !slot.as_ref().is_some_and(keep_out) {
            return None;
        }
        self.free.push(id);
        slot.take()
    }

    /// Takes the value under `id` if it is held; its id is then free.
    pub fn remove(&mut self, id: usize) -> Option<T> {
        self.remove_if(id, |_| true)
    }

    /// Takes every value held, leaving the table empty.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.free.clear();
        self.items.drain(..).flatten()
    }

    /// Values held now.
    pub fn held(&self) -> usize {
        self.items.len() - self.free.len()
    }

    /// Ids handed out so far, held or free: how large the table grew.
    pub fn ids(&self) -> usize {
        self.items.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn removed_ids_are_reused_and_only_held_ones_removed() {
        let mut s = Slots::default();
        let (a, b) = (s.insert("a"), s.insert("b"));
        assert_eq!((a, b, s.held()), (0, 1, 2));
        assert_eq!(s.remove_if(a, |v| *v == "b"), None, "refused: kept");
        assert_eq!(s.remove(a), Some("a"));
        assert_eq!(s.remove(a), None, "removed twice");
        assert_eq!(s.remove(7), None, "never handed out");
        assert_eq!(s.get(a), None);
        assert_eq!(s.insert("c"), a, "the removed id first");
        assert_eq!((s.held(), s.ids()), (2, 2));
        assert_eq!(s.drain().collect::<Vec<_>>(), ["c", "b"]);
        assert_eq!((s.held(), s.ids(), s.insert("d")), (0, 0, 0));
    }
}
