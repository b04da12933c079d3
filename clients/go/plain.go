package contextsvc

import (
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Plain returns a message in the plain shape every contextsvc client shares (for logs, JSON and
// the cross-language scenario): keys are proto field names, 64-bit integers stay int64, timestamps
// become time.Time (UTC), Struct becomes map[string]any, enums become short lower-case names ("user",
// "summary"; nil when unset), unset messages and proto3 optional fields are nil, and a real oneof
// holds only its set member plus the oneof's name naming it (e.g. "payload": "messages_appended").
func Plain(m proto.Message) map[string]any {
	return plainMessage(m.ProtoReflect())
}

func plainMessage(m protoreflect.Message) map[string]any {
	out := map[string]any{}
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() {
			if m.Has(fd) {
				out[string(fd.Name())] = plainValue(fd, m.Get(fd))
			}
			continue
		}
		switch {
		case fd.IsList():
			list := m.Get(fd).List()
			items := make([]any, list.Len())
			for j := range items {
				items[j] = plainValue(fd, list.Get(j))
			}
			out[string(fd.Name())] = items
		case fd.IsMap():
			mp := map[string]any{}
			m.Get(fd).Map().Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
				mp[k.String()] = plainValue(fd.MapValue(), v)
				return true
			})
			out[string(fd.Name())] = mp
		case fd.HasPresence() && !m.Has(fd):
			out[string(fd.Name())] = nil
		default:
			out[string(fd.Name())] = plainValue(fd, m.Get(fd))
		}
	}
	oneofs := m.Descriptor().Oneofs()
	for i := 0; i < oneofs.Len(); i++ {
		od := oneofs.Get(i)
		if od.IsSynthetic() {
			continue
		}
		if set := m.WhichOneof(od); set != nil {
			out[string(od.Name())] = string(set.Name())
		} else {
			out[string(od.Name())] = nil
		}
	}
	return out
}

func plainValue(fd protoreflect.FieldDescriptor, v protoreflect.Value) any {
	switch fd.Kind() {
	case protoreflect.EnumKind:
		return EnumName(fd.Enum(), v.Enum())
	case protoreflect.MessageKind, protoreflect.GroupKind:
		msg := v.Message().Interface()
		switch t := msg.(type) {
		case *timestamppb.Timestamp:
			return t.AsTime().UTC()
		case *structpb.Struct:
			return t.AsMap()
		}
		return plainMessage(v.Message())
	case protoreflect.BytesKind:
		if b := v.Bytes(); b != nil {
			return b
		}
		return []byte{}
	default:
		return v.Interface()
	}
}

// EnumName is an enum value's short name: ROLE_USER -> "user"; nil for the zero value.
func EnumName(ed protoreflect.EnumDescriptor, n protoreflect.EnumNumber) any {
	vd := ed.Values().ByNumber(n)
	if vd == nil || n == 0 {
		return nil
	}
	var prefix strings.Builder
	for i, r := range string(ed.Name()) {
		if i > 0 && r >= 'A' && r <= 'Z' {
			prefix.WriteByte('_')
		}
		prefix.WriteRune(r)
	}
	return strings.ToLower(strings.TrimPrefix(string(vd.Name()), strings.ToUpper(prefix.String())+"_"))
}
