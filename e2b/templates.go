package e2b

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/capsa-sandbox/capsa/agent"
	"github.com/capsa-sandbox/capsa/netstack"
	"github.com/capsa-sandbox/capsa/sandbox"
	"github.com/capsa-sandbox/capsa/supervisor"
)

// Template is what a templateID can name besides an image reference: an
// image with the sandbox's size, environment and start command, and, when
// pre-booted, the snapshot every create restores instead of booting.
type Template struct {
	Name      string    `json:"name"`
	Image     string    `json:"image"`
	CPUs      int       `json:"cpus,omitempty"`
	MemoryMiB int       `json:"memory_mib,omitempty"`
	Env       []string  `json:"env,omitempty"`
	StartCmd  string    `json:"start_cmd,omitempty"` // run in the background once the sandbox boots
	ReadyCmd  string    `json:"ready_cmd,omitempty"` // pre-booting waits until it exits 0
	Snapshot  string    `json:"snapshot,omitempty"`  // pre-booted: the snapshot creates restore
	Created   time.Time `json:"created"`
}

// TemplatesFile is where a state directory's templates are kept.
const TemplatesFile = "e2b-templates.json"

// maxTemplates bounds a state directory's templates.
const maxTemplates = 1000

// Templates are the templates of a state directory (capsa template).
type Templates struct {
	f jsonFile[Template]
}

// OpenTemplates opens the templates kept in the state directory dir.
func OpenTemplates(dir string) (*Templates, error) {
	t := &Templates{f: jsonFile[Template]{path: filepath.Join(dir, TemplatesFile), what: "templates"}}
	if _, err := t.f.load(); err != nil {
		return nil, err
	}
	return t, nil
}

// List returns the templates.
func (ts *Templates) List() ([]Template, error) { return ts.f.list() }

// Get returns the template name, if there is one.
func (ts *Templates) Get(name string) (Template, bool) {
	list, err := ts.f.load()
	if err != nil {
		return Template{}, false
	}
	i := slices.IndexFunc(list, func(t Template) bool { return t.Name == name })
	if i < 0 {
		return Template{}, false
	}
	return list[i], true
}

// Check refuses a template that could not make a sandbox, naming what is
// wrong, before anything boots.
func (t *Template) Check() error {
	if err := supervisor.CheckName(t.Name); err != nil || t.Name == "base" {
		return fmt.Errorf("template name %q: want 1 to 63 letters, digits, '_', '.' or '-' (not base)", t.Name)
	}
	if t.Image == "" {
		return fmt.Errorf("template %s: no image", t.Name)
	}
	if t.ReadyCmd != "" && t.Snapshot == "" && t.StartCmd == "" {
		return fmt.Errorf("template %s: a ready command needs a start command", t.Name)
	}
	_, err := t.workload(nil, nil, nil)
	return err
}

// publicOnly is the API's default network policy.
func publicOnly() *netstack.Policy {
	p, err := netstack.ParsePolicy("public-only", nil, nil)
	if err != nil {
		panic(err) // a constant policy
	}
	return p
}

// workload is the template's sandbox, with the network policy given (nil:
// none) and env after the template's own.
func (t *Template) workload(policy *netstack.Policy, env []string, volumes func(*sandbox.Builder) error) (*sandbox.Workload, error) {
	b := sandbox.New().Env(t.Env...).Env(env...)
	if volumes != nil {
		if err := volumes(b); err != nil {
			return nil, err
		}
	}
	if t.CPUs != 0 {
		b.CPUs(t.CPUs)
	}
	if t.MemoryMiB != 0 {
		b.Memory(t.MemoryMiB)
	}
	if policy != nil {
		b.Network(policy)
	}
	w := b.Entrypoint(keepAlive...).OCI(t.Image)
	if _, err := w.Spec(); err != nil {
		return nil, fmt.Errorf("template %s: %w", t.Name, err)
	}
	return w, nil
}

// Add keeps t, a new template.
func (ts *Templates) Add(t Template) error {
	if err := t.Check(); err != nil {
		return err
	}
	return ts.f.change(func(list []Template) ([]Template, error) {
		if len(list) >= maxTemplates {
			return nil, fmt.Errorf("e2b: %d templates exist already", len(list))
		}
		if slices.ContainsFunc(list, func(o Template) bool { return o.Name == t.Name }) {
			return nil, fmt.Errorf("e2b: a template named %s exists (capsa template rm %s first)", t.Name, t.Name)
		}
		return append(list, t), nil
	})
}

// Remove removes the template name and its pre-booted snapshot.
func (ts *Templates) Remove(m *supervisor.Manager, name string) error {
	var gone Template
	err := ts.f.change(func(list []Template) ([]Template, error) {
		i := slices.IndexFunc(list, func(o Template) bool { return o.Name == name })
		if i < 0 {
			return nil, fmt.Errorf("e2b: no template named %s", name)
		}
		gone = list[i]
		return slices.Delete(list, i, i+1), nil
	})
	if err != nil {
		return err
	}
	if gone.Snapshot != "" {
		if err := m.RemoveSnapshot(gone.Snapshot); err != nil {
			return fmt.Errorf("e2b: template %s: its snapshot: %w", name, err)
		}
	}
	return nil
}

// Preboot boots the template once, runs its start command and waits until
// its ready command succeeds (within ready), then snapshots it as the
// state directory's snapshot template-NAME, which t.Snapshot then names:
// every create from the template restores it instead of booting, with the
// start command already running.
func Preboot(ctx context.Context, m *supervisor.Manager, t *Template, ready time.Duration, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// With a network, so that sandboxes restored from it may have one.
	w, err := t.workload(publicOnly(), nil, nil)
	if err != nil {
		return err
	}
	spec, err := w.Spec()
	if err != nil {
		return err
	}
	snap := "template-" + t.Name
	if err := supervisor.CheckSnapshotName(snap); err != nil {
		return fmt.Errorf("template %s: %w", t.Name, err)
	}
	builder := "template-" + t.Name + "-build"
	// A safety net: the builder goes at the latest an hour on.
	rec := &supervisor.Record{Name: builder, Spec: spec, TTL: time.Hour}
	start := time.Now()
	if _, err := m.Launch(ctx, rec, nil); err != nil {
		m.Remove(context.WithoutCancel(ctx), builder)
		return fmt.Errorf("template %s: boot: %w", t.Name, err)
	}
	defer m.Remove(context.WithoutCancel(ctx), builder)
	log.Info("template: booted", "template", t.Name, "in", since(start))
	h, err := m.Open(ctx, builder)
	if err != nil {
		return fmt.Errorf("template %s: %w", t.Name, err)
	}
	user := ""
	if ok, _ := h.Exists(ctx, "/home/user"); ok {
		user = "user"
	}
	if t.StartCmd != "" {
		// The start command belongs to the guest: it runs on in the
		// snapshot, so in every sandbox made from it.
		if _, err := h.Stream(context.Background(), agent.ExecOptions{Argv: []string{"/bin/sh", "-c", t.StartCmd}, User: user}); err != nil {
			return fmt.Errorf("template %s: start command: %w", t.Name, err)
		}
	}
	if t.ReadyCmd != "" {
		deadline := time.Now().Add(ready)
		for {
			out, err := h.Exec(ctx, agent.ExecOptions{Argv: []string{"/bin/sh", "-c", t.ReadyCmd}, User: user, Timeout: 30 * time.Second})
			if err == nil && out.Code == 0 {
				break
			}
			if time.Now().After(deadline) {
				why := fmt.Sprint(err)
				if err == nil {
					why = fmt.Sprintf("exit %d: %s", out.Code, strings.TrimSpace(string(out.Stderr)))
				}
				return fmt.Errorf("template %s: the ready command did not succeed within %v (last: %s)", t.Name, ready, why)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(250 * time.Millisecond):
			}
		}
		log.Info("template: ready", "template", t.Name, "in", since(start))
	}
	if _, err := m.SaveSnapshot(ctx, builder, snap, "", nil); err != nil {
		return fmt.Errorf("template %s: snapshot: %w", t.Name, err)
	}
	t.Snapshot = snap
	log.Info("template: pre-booted", "template", t.Name, "snapshot", snap, "in", since(start))
	return nil
}
